"""``torch_xla.distributed.xla_multiprocessing`` (``xmp``) on xshard: replicas as processes.

``xmp.spawn(fn, args, nprocs=N)`` runs ``fn(index, *args)`` in N fresh processes, one device each,
as PyTorch/XLA's multi-process data parallel does (torch_xla >= 2.6 refuses ``nprocs`` other than
1 or None; here any count works):

- the processes are started by ``python -m xshard.launch``'s machinery (free loopback ports, each
  line of output prefixed with the rank, one failing process ends the others, none outlives the
  caller), and each joins the run with ``xshard.initialize(world="local")``: its tensors live on
  its own device, and ``xm.optimizer_step`` / ``xm.all_reduce`` meet the others in real
  collectives (see ``xshard.compat.collectives``);
- as with ``multiprocessing``'s spawn start method, ``fn`` and ``args`` are pickled, and each new
  process first runs the main script's top level as ``__mp_main__`` (so the
  ``if __name__ == '__main__':`` block that called ``spawn`` does not run again), with the same
  ``sys.argv``, ``sys.path`` and ``torch_xla`` import hook as the caller;
- ``nprocs=1`` calls ``fn(0, *args)`` in this process (world size 1); ``nprocs=None`` is one
  process per local device (on CPU: ``XSHARD_CPU_DEVICES``).

Example:
    >>> def _mp_fn(index, flags):
    ...     device = xm.xla_device()
    ...     ...
    >>> if __name__ == "__main__":
    ...     xmp.spawn(_mp_fn, args=(FLAGS,), nprocs=8)     # doctest: +SKIP
"""

from __future__ import annotations

import os
import pickle
import runpy
import subprocess
import sys
import tempfile
import types
import warnings

from xshard import launch
from xshard.compat import _world, hook
from xshard.core import distributed, runtime

_START_METHODS = ("spawn", "fork", "forkserver")
_CHILD = ("import sys; from xshard.compat import xla_multiprocessing as m; "
          "m._replica_main(sys.argv[1])")


class SpawnError(RuntimeError):
    """A process started by ``xmp.spawn`` failed (its traceback is in the output above)."""

    def __init__(self, message: str, exit_code: int, failed_rank: int | None):
        super().__init__(message)
        self.exit_code = exit_code
        self.failed_rank = failed_rank


def _local_devices() -> tuple[str, int]:
    """(platform, local device count) without holding devices in this process where possible."""
    platform, cpu_devices = runtime.configured_platform()
    if platform == "cpu":
        return "cpu", cpu_devices
    if runtime.devices.cache_info().currsize:
        return runtime.platform(), len(runtime.local_devices())
    # Ask a short-lived process: starting the backends here would hold the devices (and, on GPU,
    # most of their memory) that the replicas need.
    code = ("from xshard.core import runtime; "
            "print(runtime.platform(), len(runtime.local_devices()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=_child_env(dict(os.environ)))
    if out.returncode != 0:
        raise RuntimeError(f"xmp.spawn could not count the local devices: {out.stderr[-2000:]}")
    name, count = out.stdout.split()[-2:]
    # The short-lived process had one CPU device (the replicas' environment); this one has
    # XSHARD_CPU_DEVICES.
    return name, cpu_devices if name == "cpu" else int(count)


def _nprocs(nprocs) -> tuple[int, str | None]:
    """The number of processes, and the platform when it had to be found."""
    if nprocs is not None and (not isinstance(nprocs, int) or isinstance(nprocs, bool)
                               or nprocs < 1):
        raise ValueError(f"xmp.spawn(nprocs={nprocs!r}): nprocs must be a positive int, or None "
                         f"for one process per local device.")
    if nprocs == 1:
        return 1, None
    configured, _ = runtime.configured_platform()
    if nprocs is not None and configured == "cpu":
        return nprocs, "cpu"  # any number of processes, one virtual CPU device each
    platform, count = _local_devices()
    if nprocs is None:
        return count, platform
    if platform != "cpu" and nprocs > count:
        raise ValueError(f"xmp.spawn(nprocs={nprocs}): this host has {count} {platform} "
                         f"devices, and each process needs its own; pass nprocs <= {count} or "
                         f"None.")
    return nprocs, platform


def _child_env(env: dict) -> dict:
    """The replicas' environment: one virtual CPU device each, xshard importable."""
    env["XSHARD_CPU_DEVICES"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _main_module() -> dict:
    """How a new process finds the caller's main module (as multiprocessing's spawn does)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name != "__main__":
        return {"main_name": spec.name, "main_path": None}
    path = getattr(main, "__file__", None)
    return {"main_name": None, "main_path": os.path.abspath(path) if path else None}


def _payload(fn, args, platform: str) -> bytes:
    try:
        fn_args = pickle.dumps((fn, tuple(args)))
    except Exception as e:  # noqa: BLE001  (PicklingError, AttributeError, TypeError)
        raise TypeError(
            f"xmp.spawn sends fn and args to new processes by pickling them, as torch_xla's "
            f"start_method='spawn' does, and they do not pickle: {type(e).__name__}: {e}. Define "
            f"fn at the top level of the script or a module (not a lambda or a nested function) "
            f"and pass picklable args.") from e
    meta = {"argv": list(sys.argv), "sys_path": list(sys.path), "cwd": os.getcwd(),
            "hook": hook.installed(), "platform": platform, "fn_args": fn_args,
            **_main_module()}
    return pickle.dumps(meta)


def spawn(fn, args=(), nprocs: int | None = None, join: bool = True, daemon: bool = False,
          start_method: str = "spawn"):
    """Runs ``fn(index, *args)`` in ``nprocs`` processes, one device each (see the module
    docstring), and waits for them.

    Args:
        fn: a function defined at a module's top level, called as ``fn(index, *args)``.
        args: picklable arguments.
        nprocs: how many processes; None: one per local device; 1: in this process.
        join: must be True (spawn waits for the processes).
        daemon: accepted (the processes never outlive this one).
        start_method: ``'spawn'``, ``'fork'`` or ``'forkserver'``: every process starts fresh,
            as with ``'spawn'`` (``'fork'`` warns: nothing the parent built after its imports,
            a model included, reaches the replicas).

    Returns:
        ``fn``'s result with ``nprocs=1``; otherwise None.

    Raises:
        SpawnError: a process failed (its exit code and rank are attributes).

    Example:
        >>> xmp.spawn(_mp_fn, args=(flags,), nprocs=2)    # doctest: +SKIP
    """
    if not callable(fn):
        raise TypeError(f"xmp.spawn needs a callable fn, got {type(fn).__name__}.")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"xmp.spawn(args=...) must be a tuple of arguments, got "
                        f"{type(args).__name__}; write args=(value,).")
    if start_method not in _START_METHODS:
        raise ValueError(f"start_method={start_method!r}; valid: {list(_START_METHODS)}.")
    if start_method == "fork" and nprocs != 1:
        warnings.warn(
            "xmp.spawn(start_method='fork'): xshard.compat starts every replica fresh, as with "
            "'spawn': what this process built after its imports (a model at module level, "
            "globals its main block set) does not reach the replicas, which build their own. "
            "Seed their initialisation (torch.manual_seed) or call "
            "xm.broadcast_master_param(model) in fn so that every replica starts from the same "
            "weights.", stacklevel=2)
    if not join:
        raise ValueError("xmp.spawn(join=False) is not supported: spawn waits for its "
                         "processes. Run it in a thread if the caller must go on.")
    if _world.replicas():
        raise RuntimeError("xmp.spawn was called inside a process it started; call it once, "
                           "from the main script's `if __name__ == '__main__':` block.")
    count, platform = _nprocs(nprocs)
    if count == 1:
        return fn(0, *args)
    if _world.spmd():
        raise ValueError(
            f"xmp.spawn(nprocs={count}) after xr.use_spmd(): SPMD is one process over every "
            f"device; call fn directly (or nprocs=1), or drop xr.use_spmd() to run replicas.")
    if distributed.num_processes() > 1:
        raise RuntimeError(
            f"xmp.spawn(nprocs={count}) in a run of {distributed.num_processes()} processes "
            f"(python -m xshard.launch): replicas are started by xmp.spawn itself; run the script "
            f"as one process (python -m xshard.compat script.py).")
    if platform == "tpu":
        raise NotImplementedError(
            "xmp.spawn with several processes on TPU is not supported (each process would need "
            "its own chip bounds); run one SPMD program over every chip: nprocs=1 or "
            "xr.use_spmd().")
    payload = _payload(fn, args, platform or "cpu")
    with tempfile.TemporaryDirectory(prefix="xshard-xmp-") as tmp:
        path = os.path.join(tmp, "spawn.pkl")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(payload)
        sys.stdout.flush()
        sys.stderr.flush()
        result = launch.run([sys.executable, "-c", _CHILD, path], count,
                            env=_child_env(dict(os.environ)))
    if result.exit_code != 0:
        who = f"process {result.failed_rank}" if result.failed_rank is not None else "a process"
        raise SpawnError(f"xmp.spawn: {who} of {count} failed with exit code "
                         f"{result.exit_code} (its traceback is above).", result.exit_code,
                         result.failed_rank)
    return None


# -- in a replica ----------------------------------------------------------------------------------


def _run_main(meta: dict) -> None:
    """Runs the caller's main module as ``__mp_main__`` and makes it ``__main__`` too, so that
    ``fn`` (pickled as ``__main__.fn``) is found."""
    if meta["main_name"] is not None:
        namespace = runpy.run_module(meta["main_name"], run_name="__mp_main__", alter_sys=True)
    elif meta["main_path"] is not None:
        namespace = runpy.run_path(meta["main_path"], run_name="__mp_main__")
    else:
        return  # an interactive caller: fn must come from an importable module
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _replica_main(path: str) -> None:
    """The body of a process started by ``spawn``: join, load the main module, run ``fn``."""
    with open(path, "rb") as f:
        meta = pickle.load(f)
    sys.argv[:] = meta["argv"]
    sys.path[:] = meta["sys_path"]
    os.chdir(meta["cwd"])
    if meta["hook"]:
        hook.install()
    settings = runtime.distributed_settings()
    device_ids = None if meta["platform"] == "cpu" else [settings.local_rank or 0]
    distributed.initialize(world="local", local_device_ids=device_ids)
    _run_main(meta)
    fn, args = pickle.loads(meta["fn_args"])
    fn(distributed.process_id(), *args)


# -- the rest of xmp -------------------------------------------------------------------------------


class MpModelWrapper:
    """Holds a model for the replicas (torch_xla shares its memory across forked processes; each
    spawned process here has its own copy anyway). ``wrapper.to(device)`` returns the model there.
    """

    def __init__(self, model):
        self._model = model

    def to(self, device):
        return self._model.to(device)


class MpSerialExecutor:
    """Runs a function on one replica at a time, in ordinal order (e.g. downloading a dataset)."""

    def run(self, fn):
        from xshard.compat import xla_model as xm

        result = None
        for ordinal in range(_world.world_size()):
            if ordinal == _world.ordinal():
                result = fn()
            xm.rendezvous(f"torch_xla.distributed.xla_multiprocessing.MpSerialExecutor.{ordinal}")
        return result


__all__ = ["spawn", "SpawnError", "MpModelWrapper", "MpSerialExecutor"]
