"""Joining a multi-process run: ``initialize()``, the coordinator's key-value store, fail-fast.

xshard follows JAX's multi-controller model: every process runs the same script and traces the
same programs; each owns the shards on its local devices. JAX's runtime does the work (the
coordination service, its key-value store, gloo / NCCL / ICI collectives, global ``jax.Array``);
this module only starts it and wraps what xshard needs from it:

- ``initialize()`` finds the run's shape (explicit arguments, ``python -m xshard.launch``'s
  variables, torchrun's, a SLURM / Open MPI / Cloud TPU environment), meets the other processes
  through a torch ``TCPStore`` (so that a missing process gives an error saying how many joined),
  starts ``jax.distributed``, creates a gloo ``torch.distributed`` process group (for
  ``DistributedSampler()``, ``torch.distributed.checkpoint``), installs the fail-fast hooks and
  agrees on the device random seed. With one process it does nothing, so every script may call it.
- ``KeyValueStore``: the coordinator's key-value store. This is the one place xshard reaches into
  JAX's private ``jax._src.distributed`` (``multihost_utils`` does the same).
- Fail fast: an uncaught exception on any process prints its traceback, publishes itself under
  ``xshard/fail/<process>`` (peers waiting at a sync quote it) and ends the process with
  ``os._exit(1)``, so the run ends within seconds instead of at JAX's shutdown timeout.

[Note: what is agreed across processes, and where]
- the programs each sync, evaluate and collective read runs: ``xshard.core.divergence``;
- the values copied to the devices (a sampled digest of each upload): ``xshard.core.divergence``;
- the device random seed, once, here (process 0's ``torch.initial_seed()``);
- FSDP's initial parameters: ``xshard.fsdp.fully_shard`` (checked, or broadcast).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import functools
import ipaddress
import json
import os
import socket
import sys
import sysconfig
import threading

from xshard.core import runtime

# True once initialize() has joined a run of more than one process; every multi-process code path
# tests this flag first, so a single-process run pays one attribute read.
ACTIVE = False


class InitializationError(RuntimeError):
    """``xshard.initialize()`` could not join the run (a process missing, bad settings...)."""


@dataclasses.dataclass
class _Plan:
    source: str                 # where the settings came from (for messages)
    coordinator: str | None     # JAX coordinator "host:port"; None: agreed through the store
    num_processes: int | None
    process_id: int | None
    store: tuple | None         # (host, port) of the torch TCPStore used to meet; None: none
    agent_store: bool = False   # torchrun's agent already hosts that store


class _State:
    joined: str | None = None       # None: initialize() not called; else the source it used
    kv: "KeyValueStore | None" = None
    store = None                    # the torch TCPStore of the rendezvous, if any
    listen_socket = None            # kept open: the store listens on it (loopback runs)
    process_id = 0
    num_processes = 1
    seed: int | None = None         # the device random seed agreed at initialize()
    last_check = (0, "")            # (checks passed, site of the last one), for the exit notice


# -- the key-value store ---------------------------------------------------------------------------


class CoordinatorUnavailableError(RuntimeError):
    """The coordinator's key-value store cannot be reached (process 0 has probably ended)."""


class KeyValueStore:
    """JAX's coordinator key-value store: string keys and values, visible to every process.

    Keys under ``xshard/`` are xshard's. Example:
        >>> kv = distributed.kv()                            # doctest: +SKIP
        >>> kv.set(f"xshard/demo/{pid}", "hello")
        >>> kv.get("xshard/demo/0", timeout_s=5.0)
    """

    def __init__(self, client):
        self._client = client

    def set(self, key: str, value: str, overwrite: bool = False) -> None:
        try:
            self._client.key_value_set(key, value, allow_overwrite=overwrite)
        except Exception as e:  # noqa: BLE001  (JaxRuntimeError: the service is gone)
            raise CoordinatorUnavailableError(f"setting {key!r}: {e}") from e

    def get(self, key: str, timeout_s: float) -> str | None:
        """The value of ``key``, waiting up to ``timeout_s`` for it to be set; None if it is not."""
        try:
            return self._client.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
        except Exception as e:  # noqa: BLE001
            if "DEADLINE_EXCEEDED" in str(e):
                return None
            raise CoordinatorUnavailableError(f"reading {key!r}: {e}") from e

    def try_get(self, key: str) -> str | None:
        try:
            return self._client.key_value_try_get(key)
        except Exception as e:  # noqa: BLE001
            if "NOT_FOUND" in str(e):
                return None
            raise CoordinatorUnavailableError(f"reading {key!r}: {e}") from e

    def items(self, prefix: str) -> list[tuple[str, str]]:
        """Every (key, value) whose key starts with ``prefix`` + '/'."""
        try:
            return list(self._client.key_value_dir_get(prefix))
        except Exception as e:  # noqa: BLE001
            raise CoordinatorUnavailableError(f"listing {prefix!r}: {e}") from e

    def delete(self, key: str) -> None:
        """Deletes ``key`` and every key under ``key + '/'``."""
        try:
            self._client.key_value_delete(key)
        except Exception as e:  # noqa: BLE001
            raise CoordinatorUnavailableError(f"deleting {key!r}: {e}") from e


def kv() -> KeyValueStore:
    """The coordinator's key-value store (only in a multi-process run)."""
    if _State.kv is None:
        raise RuntimeError("The key-value store exists only in a multi-process run: call "
                           "xshard.initialize() under python -m xshard.launch, torchrun or srun.")
    return _State.kv


def _jax_client():
    from jax._src import distributed as jax_distributed  # private: see KeyValueStore

    return jax_distributed.global_state.client


# -- process information ---------------------------------------------------------------------------


def process_id() -> int:
    """This process's index (0 in a single-process run), known without touching the devices."""
    return _State.process_id


def num_processes() -> int:
    """The number of processes (1 in a single-process run), known without touching the devices."""
    return _State.num_processes


def local_device_count() -> int:
    """The number of devices attached to this process.

    Example:
        >>> xshard.local_device_count()    # 4 in a 2-process run with 4 CPU devices each
        4
    """
    return len(runtime.local_devices())


def is_main_process() -> bool:
    """Whether this is process 0: the one to log, write files and print summaries from.

    Reads of device values are collective (see the README, "Multi-host"): read on every process,
    then print from the main one::

        loss_value = loss.item()            # every process
        if xshard.is_main_process():
            print(f"step {step}: {loss_value:.4f}")
    """
    return _State.process_id == 0


# -- initialize ------------------------------------------------------------------------------------


def _split(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InitializationError(f"{what}={address!r} must be 'host:port', e.g. '10.0.0.1:1234'.")
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _resolve(coordinator_address, num_processes, process_id,
             settings: runtime.DistributedSettings) -> _Plan | None:
    """Where the run's settings come from, in order: arguments, xshard.launch, torchrun, cluster."""
    s = settings
    store = None
    if s.master_addr is not None and s.master_port is not None:
        store = (s.master_addr, s.master_port)
    explicit = (coordinator_address, num_processes, process_id) != (None, None, None)
    if explicit or s.num_processes is not None:
        source = "arguments" if explicit else "xshard.launch (XSHARD_* variables)"
        coordinator = coordinator_address or s.coordinator_address
        n = num_processes if num_processes is not None else (
            s.num_processes if s.num_processes is not None else s.world_size)
        pid = process_id if process_id is not None else (
            s.process_id if s.process_id is not None else s.rank)
        if n is None or pid is None:
            raise InitializationError(
                f"xshard.initialize() needs num_processes and process_id with {source} (got "
                f"num_processes={n}, process_id={pid}); pass both, or start the processes with "
                f"python -m xshard.launch --nproc N, torchrun or srun, which set them.")
        if coordinator is None and store is None and n > 1:
            raise InitializationError(
                "xshard.initialize() needs coordinator_address='host:port' (process 0's host and a "
                "free port) when the processes were not started by python -m xshard.launch or "
                "torchrun.")
        if coordinator is not None and store is None:
            host, port = _split(coordinator, "coordinator_address")
            store = (host, port + 1)  # documented: the rendezvous store uses the next port
        plan = _Plan(source, coordinator, n, pid, store)
    elif s.world_size is not None and s.rank is not None:
        if store is None:
            raise InitializationError(
                f"torchrun variables RANK={s.rank} and WORLD_SIZE={s.world_size} are set, but "
                f"MASTER_ADDR/MASTER_PORT are not; set them (torchrun does), or pass "
                f"coordinator_address to xshard.initialize().")
        plan = _Plan("torchrun (RANK/WORLD_SIZE/MASTER_ADDR)", None, s.world_size, s.rank,
                     store, agent_store=s.agent_store)
    elif s.cluster is not None:
        return _Plan(s.cluster, None, None, None, None)
    else:
        return None
    if not isinstance(plan.num_processes, int) or plan.num_processes < 1:
        raise InitializationError(f"num_processes must be a positive int, got "
                                  f"{plan.num_processes!r} (from {plan.source}).")
    if not isinstance(plan.process_id, int) or not 0 <= plan.process_id < plan.num_processes:
        raise InitializationError(
            f"process_id must be an int in [0, {plan.num_processes}), got {plan.process_id!r} "
            f"(from {plan.source}).")
    return plan


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None,
               torch_distributed: bool = True, timeout: float | None = None,
               heartbeat_timeout: float | None = None, shutdown_timeout: float | None = None,
               world: str = "global", **jax_kwargs) -> None:
    """Joins a multi-process run, or does nothing in a single process.

    The settings come from, in order: the arguments; ``python -m xshard.launch``'s variables
    (``XSHARD_COORDINATOR_ADDRESS``, ``XSHARD_NUM_PROCESSES``, ``XSHARD_PROCESS_ID``); torchrun's
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); JAX's cluster detection, tried
    only when a SLURM, Open MPI or Cloud TPU environment is present. With none of them, or one
    process, this returns at once: call it at the top of every script.

    With several processes it meets the others (an error says how many joined if some are
    missing), starts ``jax.distributed`` (its coordinator bound to the loopback address when the
    address is one), creates a gloo ``torch.distributed`` process group, makes an uncaught
    exception on any process end the whole run within seconds, and seeds every process's device
    random stream alike (process 0's ``torch.initial_seed()``).

    Call it before anything touches the devices (a tensor on ``xshard.device()``, a mesh).

    Args:
        coordinator_address: ``'host:port'`` of process 0's JAX coordinator.
        num_processes: how many processes the run has.
        process_id: this process's index.
        local_device_ids: the local devices this process uses (GPU: one process per device).
        torch_distributed: also create the gloo ``torch.distributed`` process group.
        timeout: seconds to wait for every process to join (default ``XSHARD_INIT_TIMEOUT``, 300).
        heartbeat_timeout: seconds without a heartbeat before JAX declares a process dead
            (default ``XSHARD_HEARTBEAT_TIMEOUT``, 60).
        shutdown_timeout: seconds JAX waits for the others at exit (``XSHARD_SHUTDOWN_TIMEOUT``, 60).
        world: ``"global"`` (one program over every process's devices) or ``"local"``: each
            process is a world of its own whose tensors live on its local devices, and processes
            meet only in explicit collectives (xshard.compat's ``xmp.spawn`` replicas; see [Note:
            the local world] in ``xshard.core.runtime``).
        **jax_kwargs: passed on to ``jax.distributed.initialize``.

    Raises:
        InitializationError: a process did not join in time, or the settings are inconsistent.
        RuntimeError: the devices were used before this call.

    Example:
        >>> import xshard
        >>> xshard.initialize()          # python -m xshard.launch --nproc 2 train.py
        >>> xshard.process_count(), xshard.process_index()   # doctest: +SKIP
        (2, 1)
    """
    if world not in ("global", "local"):
        raise ValueError(f"world={world!r} is not a world xshard knows; valid values: 'global' "
                         f"(one program over every process's devices) or 'local' (each process "
                         f"its own world).")
    settings = runtime.distributed_settings()
    plan = _resolve(coordinator_address, num_processes, process_id, settings)
    if _State.joined is not None:
        if _State.joined == "single" and plan is not None and plan.num_processes != 1 and \
                (coordinator_address, num_processes, process_id) != (None, None, None):
            raise RuntimeError("xshard.initialize() was already called (single process); call it "
                               "once, with the run's arguments, at the top of the program.")
        return  # idempotent: the first call decided
    if plan is None or plan.num_processes == 1:
        _State.joined = "single"
        return
    if runtime.devices.cache_info().currsize:
        raise RuntimeError(
            "xshard.initialize() must run before the devices are first used (a tensor on "
            "xshard.device(), a Mesh, xshard.device_count()); call it at the top of the program.")
    if world == "local":
        runtime.use_local_world()
    init_timeout = float(timeout if timeout is not None else settings.init_timeout)
    if plan.store is not None:
        _State.store = _rendezvous(plan, init_timeout)
    coordinator = plan.coordinator
    if coordinator is None and _State.store is not None:
        coordinator = _agree_coordinator(_State.store, plan)
    kwargs = dict(
        initialization_timeout=max(1, int(round(init_timeout))),
        heartbeat_timeout_seconds=max(1, int(round(
            heartbeat_timeout if heartbeat_timeout is not None else settings.heartbeat_timeout))),
        shutdown_timeout_seconds=max(1, int(round(
            shutdown_timeout if shutdown_timeout is not None else settings.shutdown_timeout))),
    )
    if coordinator is not None and _is_loopback(_split(coordinator, "coordinator_address")[0]):
        kwargs["coordinator_bind_address"] = coordinator  # not [::] on every interface
    kwargs.update(jax_kwargs)
    jax = runtime.jax_module()
    jax.distributed.initialize(coordinator, plan.num_processes, plan.process_id,
                               local_device_ids=local_device_ids, **kwargs)
    _State.kv = KeyValueStore(_jax_client())
    _State.process_id = jax.process_index()
    _State.num_processes = jax.process_count()
    _State.joined = plan.source
    global ACTIVE
    ACTIVE = _State.num_processes > 1 and world == "global"
    if _State.num_processes == 1:
        return
    if torch_distributed:
        _init_torch_distributed(init_timeout)
    # After torch.distributed: its excepthook collects the traceback into a buffer around the hook
    # it wraps, so ours must wrap it (print, publish, then end), not the other way round.
    _install_fail_fast()
    _agree_seed(init_timeout)


def _rendezvous(plan: _Plan, timeout: float):
    """Meets every process at a torch TCPStore; raises with how many joined if some are missing."""
    import torch.distributed as dist

    host, port = plan.store
    n, pid = plan.num_processes, plan.process_id
    master = pid == 0 and not plan.agent_store
    listen_fd = None
    if master and _is_loopback(host):
        # TCPStore alone listens on every interface; a loopback run stays on loopback.
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise InitializationError(
                f"process 0 cannot listen on {host}:{port} for the rendezvous ({e}); choose "
                f"another MASTER_PORT (python -m xshard.launch picks free ones).") from e
        sock.listen(max(128, n))
        _State.listen_socket = sock
        listen_fd = sock.fileno()
    where = f"{host}:{port}"
    try:
        store = dist.TCPStore(host, port, n, is_master=master,
                              timeout=datetime.timedelta(seconds=timeout),
                              wait_for_workers=False, master_listen_fd=listen_fd)
    except Exception as e:  # noqa: BLE001  (DistStoreError, RuntimeError: unreachable)
        raise InitializationError(
            f"process {pid} of {n} could not reach process 0's rendezvous at {where} within "
            f"{timeout:g} s ({type(e).__name__}: {e}). Every process must run this script at the "
            f"same time: start them with python -m xshard.launch --nproc {n}, torchrun or srun; "
            f"check MASTER_ADDR/MASTER_PORT, or raise XSHARD_INIT_TIMEOUT.") from e
    if plan.agent_store:
        return store  # torchrun's agents have already met
    joined = store.add("xshard/joined", 1)
    if joined == n:
        store.set("xshard/everyone", "1")
    try:
        store.wait(["xshard/everyone"], datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001
        count = store.add("xshard/joined", 0)
        raise InitializationError(
            f"xshard.initialize(): {count} of {n} processes joined within {timeout:g} s "
            f"(rendezvous at {where}, this is process {pid}, settings from {plan.source}). Every "
            f"process must run this script at the same time: start them together with python -m "
            f"xshard.launch --nproc {n}, torchrun or srun, or raise XSHARD_INIT_TIMEOUT.") from e
    return store


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host if _is_loopback(host) else "", 0))
        return s.getsockname()[1]


def _agree_coordinator(store, plan: _Plan) -> str:
    """torchrun: process 0 picks the JAX coordinator's port on its host and tells the others."""
    host = plan.store[0]
    if plan.process_id == 0:
        store.set("xshard/coordinator", f"{host}:{_free_port(host)}")
    return store.get("xshard/coordinator").decode()


def _init_torch_distributed(timeout: float) -> None:
    """A gloo process group over the same processes (DistributedSampler(), DCP, broadcasts)."""
    import torch.distributed as dist

    pid, n = _State.process_id, _State.num_processes
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (pid, n):
            raise InitializationError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but this is process {pid} of {n}; initialise it with "
                f"the same rank and world size, or let xshard.initialize() create it.")
        return
    store = _State.store
    if store is None:  # cluster detection: process 0 hosts a store and publishes its address
        host = _split(_coordinator_address(), "coordinator address")[0]
        if pid == 0:
            port = _free_port(host)
            store = dist.TCPStore(host, port, n, is_master=True,
                                  timeout=datetime.timedelta(seconds=timeout),
                                  wait_for_workers=False)
            kv().set("xshard/torch_store", f"{host}:{port}")
        else:
            address = kv().get("xshard/torch_store", timeout)
            if address is None:
                raise InitializationError("process 0 did not publish its torch.distributed "
                                          f"store within {timeout:g} s.")
            h, p = _split(address, "torch store")
            store = dist.TCPStore(h, p, n, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout))
        _State.store = store
    dist.init_process_group("gloo", store=dist.PrefixStore("xshard/pg", store), rank=pid,
                            world_size=n, timeout=datetime.timedelta(seconds=timeout))


def _coordinator_address() -> str:
    from jax._src import distributed as jax_distributed  # private: see KeyValueStore

    return jax_distributed.global_state.coordinator_address


def _agree_seed(timeout: float) -> None:
    """Every process's device random stream starts from process 0's ``torch.initial_seed()``
    (unless a process seeds it itself, which the sync check then compares)."""
    import torch

    if _State.process_id == 0:
        kv().set("xshard/seed", str(torch.initial_seed()))
    seed = kv().get("xshard/seed", timeout)
    if seed is None:
        raise InitializationError(f"process 0 did not publish the random seed within "
                                  f"{timeout:g} s.")
    _State.seed = int(seed)


def agreed_seed() -> int | None:
    """The seed an unseeded device random stream starts from in a multi-process run (process
    0's ``torch.initial_seed()``, agreed at ``initialize()``); None otherwise."""
    return _State.seed


# -- call sites --------------------------------------------------------------------------------------


@functools.cache
def _library_dirs() -> tuple:
    import numpy
    import torch

    jax = runtime.jax_module()
    dirs = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # xshard/
    for module in (torch, jax, numpy):
        dirs.append(os.path.dirname(os.path.abspath(module.__file__)))
    for key in ("stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.append(os.path.abspath(path))
    return tuple(d + os.sep for d in dirs)


@functools.lru_cache(maxsize=4096)
def is_library_file(filename: str) -> bool:
    """Whether ``filename`` belongs to xshard, torch, jax, numpy or the standard library."""
    if filename.startswith("<"):
        return True
    return os.path.abspath(filename).startswith(_library_dirs())


@functools.lru_cache(maxsize=4096)
def short_path(filename: str) -> str:
    """``filename`` relative to the working directory when it lies below it."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel


def site(depth: int = 1) -> str:
    """``'path:line'`` of the innermost calling frame outside the libraries: the user's line."""
    frame = sys._getframe(depth)
    outermost = frame
    while frame is not None:
        if not is_library_file(frame.f_code.co_filename):
            return f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"
        outermost = frame
        frame = frame.f_back
    return f"{short_path(outermost.f_code.co_filename)}:{outermost.f_lineno}"


def note_check(count: int, where: str) -> None:
    """Records the last check (for the notice a process leaves when it exits)."""
    _State.last_check = (count, where)


# -- fail fast ---------------------------------------------------------------------------------------


_PUBLISH_WAIT_S = 1.0


def publish_failure(kind: str, text: str, site: str = "") -> None:
    """Tells the other processes this one is ending (``kind``: 'error' or 'exit'), waiting at most
    a second for the coordinator (it may be gone already)."""
    if _State.kv is None:
        return
    value = json.dumps({"kind": kind, "text": text[:4000], "site": site})
    key = f"xshard/fail/{_State.process_id}"

    def publish():
        try:
            _State.kv.set(key, value, overwrite=True)
        except Exception:  # noqa: BLE001  (best effort: the coordinator may have ended)
            pass

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    thread.join(_PUBLISH_WAIT_S)


def failures() -> dict[int, dict]:
    """What other processes published when they ended: process -> {kind, text, site}."""
    out = {}
    for key, value in kv().items("xshard/fail"):
        try:
            out[int(key.rsplit("/", 1)[1])] = json.loads(value)
        except (ValueError, IndexError):
            continue
    return out


def _error_site(tb) -> str:
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    user = [f for f in frames if not is_library_file(f[0])]
    filename, line = (user or frames or [("?", 0)])[-1]
    return f"{short_path(filename)}:{line}"


def _end_now(exc: BaseException, tb) -> None:
    text = f"{type(exc).__name__}: {exc}"
    publish_failure("error", text, _error_site(tb))
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(1)


def _install_fail_fast() -> None:
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        try:
            previous(exc_type, exc, tb)
        finally:
            _end_now(exc, tb)

    sys.excepthook = excepthook
    previous_thread = threading.excepthook

    def thread_excepthook(args):
        try:
            previous_thread(args)
        finally:
            if args.exc_type is not SystemExit:
                _end_now(args.exc_value, args.exc_traceback)

    threading.excepthook = thread_excepthook
    atexit.register(_on_exit)


def _on_exit() -> None:
    n, where = _State.last_check
    publish_failure("exit", f"after {n} checks", where)


__all__ = ["initialize", "InitializationError", "KeyValueStore", "kv", "local_device_count",
           "is_main_process", "process_id", "num_processes", "publish_failure", "failures",
           "CoordinatorUnavailableError", "ACTIVE", "agreed_seed", "site", "is_library_file"]
