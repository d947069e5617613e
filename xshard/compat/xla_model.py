"""``torch_xla.core.xla_model`` (``xm``) on xshard.

Tensors live on the ``xshard`` device (``xm.xla_device()`` returns ``xshard.device()``). In
processes started by ``xmp.spawn(fn, nprocs=N)`` each replica trains on its own data and
``xm.optimizer_step`` averages the gradients across them, as PyTorch/XLA's multi-process data
parallel does; elsewhere there is one program, world size 1 (see ``xshard.compat._world``).

Example (the classic recipe, unchanged):
    >>> import torch_xla.core.xla_model as xm           # python -m xshard.compat train.py
    >>> device = xm.xla_device()
    >>> sampler = DistributedSampler(data, num_replicas=xm.xrt_world_size(),
    ...                              rank=xm.get_ordinal())                  # doctest: +SKIP
    >>> loss.backward(); xm.optimizer_step(optimizer)                        # doctest: +SKIP
    >>> xm.save(model.state_dict(), "model.pt")   # once, from the master    # doctest: +SKIP
"""

from __future__ import annotations

import io
import struct
import sys
import time

import torch
import torch.utils._pytree as pytree

import xshard
from xshard.compat import _world, collectives
from xshard.core import api, rng, runtime

REDUCE_SUM = "sum"
REDUCE_MUL = "mul"
REDUCE_AND = "and"
REDUCE_OR = "or"
REDUCE_MIN = "min"
REDUCE_MAX = "max"

_PLATFORM_NAMES = {"cpu": "CPU", "gpu": "CUDA", "cuda": "CUDA", "rocm": "ROCM", "tpu": "TPU"}


# -- devices ---------------------------------------------------------------------------------------


def xla_device(n: int | None = None, devkind: str | None = None) -> torch.device:
    """This process's device: ``xshard.device()`` (``xshard:0``).

    Args:
        n: None or 0. xshard has one logical device per process (over all its physical devices
            in one program, or the replica's one device under ``xmp.spawn``).
        devkind: None, or the platform's name (``xr.device_type()``, e.g. ``'CPU'``).

    Returns:
        ``torch.device('xshard', 0)``.

    Example:
        >>> model = model.to(xm.xla_device())    # doctest: +SKIP
    """
    if n is not None and n != 0:
        raise ValueError(
            f"xm.xla_device(n={n!r}): xshard has one logical device per process, xshard:0 (index "
            f"0 or None). To use several devices, run replicas with xmp.spawn(fn, nprocs=N) (one "
            f"device each) or shard one program over them with xshard.spmd / xshard.fsdp.")
    if devkind is not None and str(devkind).upper() != device_type():
        raise ValueError(f"xm.xla_device(devkind={devkind!r}): this process's devices are "
                         f"{device_type()}; pass devkind=None.")
    return xshard.device()


def device_type() -> str:
    """The platform in torch_xla's words: ``'CPU'``, ``'CUDA'`` or ``'TPU'``."""
    platform = runtime.platform()
    return _PLATFORM_NAMES.get(platform, platform.upper())


def xla_device_hw(device) -> str:
    """The hardware behind ``device`` (an xshard device): ``'CPU'``, ``'CUDA'`` or ``'TPU'``."""
    _check_device(device)
    return device_type()


def get_xla_supported_devices(devkind: str | None = None, max_devices: int | None = None) -> list:
    """The devices a process can name: ``['xshard:0']`` (one logical device)."""
    if devkind is not None and str(devkind).upper() != device_type():
        return []
    return [str(xshard.device())][:max_devices]


def _check_device(device) -> None:
    if device is not None and torch.device(device).type != xshard.device().type:
        raise ValueError(f"{device!r} is not an xshard device; pass xm.xla_device().")


# -- who am I -------------------------------------------------------------------------------------


def xrt_world_size(defval: int = 1) -> int:
    """The number of replicas (``xr.world_size()``; removed in torch_xla 2.8, kept here).

    Example:
        >>> DistributedSampler(data, num_replicas=xm.xrt_world_size(), rank=xm.get_ordinal())
    """
    return _world.world_size()


def get_ordinal(defval: int = 0) -> int:
    """This replica's global ordinal (``xr.global_ordinal()``; removed in torch_xla 2.8)."""
    return _world.ordinal()


def get_local_ordinal(defval: int = 0) -> int:
    """This replica's ordinal among those of its host."""
    return _world.local_ordinal()


def is_master_ordinal(local: bool = True) -> bool:
    """Whether this replica is the (local, or with ``local=False`` global) master: the one that
    prints and writes files."""
    return _world.is_master(local)


def master_print(*args, fd=None, local: bool = False, flush: bool = False) -> None:
    """``print`` (to ``fd``, default ``sys.stdout``) on the global master (``local=True``: on
    each host's master) only."""
    if is_master_ordinal(local=local):
        print(*args, file=sys.stdout if fd is None else fd, flush=flush)


# -- steps -----------------------------------------------------------------------------------------


class _Closures:
    queue: list = []


def add_step_closure(closure, args=(), run_async: bool = False) -> None:
    """Runs ``closure(*args)`` after the next step (``xm.mark_step()``, which the loaders of
    ``torch_xla.distributed.parallel_loader`` call before each batch), when the step's values can
    be read without holding up tracing.

    Closures run in the order they were added, in the calling thread; ``run_async=True`` is
    accepted and runs the closure the same way.

    Example:
        >>> xm.add_step_closure(lambda loss: print(loss.item()), args=(loss,))   # doctest: +SKIP
    """
    if not callable(closure):
        raise TypeError(f"add_step_closure needs a callable, got {type(closure).__name__}.")
    _Closures.queue.append((closure, tuple(args)))


def _run_step_closures() -> None:
    closures, _Closures.queue = _Closures.queue, []
    for closure, args in closures:
        closure(*args)


def mark_step(wait: bool = False, reset_scope: bool = True) -> None:
    """Ends the step: runs the pending work as one compiled program (``xshard.sync()``), then the
    step closures.

    Args:
        wait: block until the work has finished.
        reset_scope: accepted for compatibility (xshard has no IR scopes).
    """
    xshard.sync(wait=wait)
    _run_step_closures()


def wait_device_ops(devices=()) -> None:
    """Blocks until all dispatched device work has finished."""
    xshard.wait()


def optimization_barrier_(tensors) -> None:
    """Keeps XLA from moving computation across ``tensors`` (in place)."""
    xshard.optimization_barrier_(tensors)


# -- collectives -----------------------------------------------------------------------------------


def _check_reduce_type(reduce_type) -> str:
    if reduce_type not in collectives.REDUCE_TYPES:
        raise ValueError(
            f"reduce_type={reduce_type!r} is not a reduction xm knows; valid: xm.REDUCE_SUM, "
            f"REDUCE_MUL, REDUCE_AND, REDUCE_OR, REDUCE_MIN, REDUCE_MAX "
            f"({', '.join(map(repr, collectives.REDUCE_TYPES))}).")
    return reduce_type


def _check_groups(groups, what: str) -> None:
    if groups is None:
        return
    n = _world.world_size()
    flat = sorted(r for g in groups for r in g) if isinstance(groups, (list, tuple)) else None
    if flat == list(range(n)) and len(groups) == 1:
        return  # one group of every replica: the default
    raise NotImplementedError(
        f"{what}(groups={groups!r}): only one group of all {n} replicas is supported; reduce over "
        f"all of them (groups=None), or run one SPMD program and use xshard.spmd's collectives "
        f"over a mesh axis.")


def _check_device_tensors(tensors: list, what: str) -> None:
    for i, t in enumerate(tensors):
        if not api.is_device_tensor(t):
            raise TypeError(f"{what}: input {i} is a {type(t).__name__} on "
                            f"{getattr(t, 'device', '?')}, not an xshard tensor; move it with "
                            f".to(xm.xla_device()).")


def all_reduce(reduce_type: str, inputs, scale: float = 1.0, groups=None, output=None,
               pin_layout: bool = True):
    """Reduces ``inputs`` across the replicas (``reduce_type``: ``xm.REDUCE_SUM``, ...), then
    multiplies by ``scale``.

    Args:
        reduce_type: ``REDUCE_SUM``, ``REDUCE_MUL``, ``REDUCE_AND``, ``REDUCE_OR``,
            ``REDUCE_MIN`` or ``REDUCE_MAX``.
        inputs: one xshard tensor, or a list of them (reduced in place, one collective per dtype).
        scale: a factor applied to the result (floating-point tensors; 1.0 for the others).
        groups: None (all replicas).
        output, pin_layout: accepted for compatibility (``output`` must be None).

    Returns:
        For a tensor: a new tensor with the result. For a list: the same list, its tensors now
        holding the results.

    Example:
        >>> total = xm.all_reduce(xm.REDUCE_SUM, correct)          # doctest: +SKIP
        >>> xm.all_reduce(xm.REDUCE_SUM, grads, scale=1.0 / xm.xrt_world_size())  # doctest: +SKIP
    """
    _check_reduce_type(reduce_type)
    _check_groups(groups, "xm.all_reduce")
    if output is not None:
        raise NotImplementedError("xm.all_reduce(output=...) is not supported; use the returned "
                                  "tensor (or pass a list, which is reduced in place).")
    single = isinstance(inputs, torch.Tensor)
    tensors = [inputs] if single else list(inputs)
    _check_device_tensors(tensors, "xm.all_reduce")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a number, got {type(scale).__name__}.")
    if scale != 1.0:
        for t in tensors:
            if not t.dtype.is_floating_point:
                raise ValueError(f"xm.all_reduce(scale={scale!r}) of a {t.dtype} tensor: a scale "
                                 f"applies to floating-point tensors only; pass scale=1.0.")
    if not tensors:
        return inputs
    with torch.no_grad():
        if _world.world_size() == 1:  # the reduction of one value is that value
            if single:
                return inputs * scale if scale != 1.0 else inputs.clone()
            if scale != 1.0:
                for t in tensors:
                    t.mul_(scale)
            return inputs
        results = collectives.all_reduce(reduce_type, tensors, scale)
        if single:
            return api.new_tensor(results[0])
        for t, node in zip(tensors, results):
            api.write(t, node)
    return inputs


def all_gather(value: torch.Tensor, dim: int = 0, groups=None, output=None,
               pin_layout: bool = True) -> torch.Tensor:
    """The replicas' values of ``value`` concatenated along ``dim``, in ordinal order.

    Example:
        >>> everyone = xm.all_gather(predictions)     # (world * batch, ...)  # doctest: +SKIP
    """
    _check_groups(groups, "xm.all_gather")
    if output is not None:
        raise NotImplementedError("xm.all_gather(output=...) is not supported; use the returned "
                                  "tensor.")
    _check_device_tensors([value], "xm.all_gather")
    if value.dim() == 0:
        raise ValueError("xm.all_gather needs a tensor with at least one dimension; got a 0-dim "
                         "tensor. Gather value.reshape(1) instead.")
    if not -value.dim() <= dim < value.dim():
        raise ValueError(f"dim={dim} is out of range for a {value.dim()}-dim tensor.")
    dim = dim % value.dim()
    with torch.no_grad():
        if _world.world_size() == 1:
            return value.clone()
        return collectives.all_gather(value, dim)


def reduce_gradients(optimizer, groups=None, pin_layout: bool = True) -> None:
    """Averages the gradients of ``optimizer``'s parameters across the replicas (a sum times
    1/world size, one collective per dtype). Nothing happens with one replica."""
    count = _world.world_size()
    if count > 1:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        all_reduce(REDUCE_SUM, grads, scale=1.0 / count, groups=groups)


def optimizer_step(optimizer, barrier: bool = False, optimizer_args: dict | None = None,
                   groups=None, pin_layout: bool = True):
    """Averages the gradients across the replicas, then runs ``optimizer.step()``.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over xshard parameters.
        barrier: end the step afterwards (``xm.mark_step()``); the parallel loaders do it before
            each batch, so loops over them need no barrier.
        optimizer_args: keyword arguments for ``optimizer.step``.
        groups, pin_layout: as in ``all_reduce``.

    Returns:
        What ``optimizer.step`` returns.

    Example:
        >>> loss.backward()
        >>> xm.optimizer_step(optimizer)     # doctest: +SKIP
    """
    reduce_gradients(optimizer, groups=groups, pin_layout=pin_layout)
    loss = optimizer.step(**(optimizer_args or {}))
    if barrier:
        mark_step()
    return loss


def rendezvous(tag: str, payload: bytes = b"", replicas=()) -> list:
    """Waits for every replica to reach ``rendezvous(tag)`` and returns their payloads, in ordinal
    order. Pending device work is dispatched first (as torch_xla does).

    Args:
        tag: the same string on every replica (a mismatch raises ``RendezvousMismatchError``).
        payload: bytes to share.
        replicas: () or every ordinal.

    Example:
        >>> xm.rendezvous("checkpoint written")     # doctest: +SKIP
    """
    if not isinstance(payload, (bytes, bytearray)):
        raise TypeError(f"rendezvous payload must be bytes, got {type(payload).__name__}.")
    n = _world.world_size()
    if replicas and sorted(replicas) != list(range(n)):
        raise NotImplementedError(f"xm.rendezvous(replicas={list(replicas)!r}): only all {n} "
                                  f"replicas can meet; pass replicas=().")
    xshard.sync()
    if n == 1:
        return [bytes(payload)]
    return collectives.exchange_objects(str(tag), bytes(payload))


def mesh_reduce(tag: str, data, reduce_fn):
    """``reduce_fn`` of every replica's ``data`` (tensors moved to CPU), computed on every replica.

    Example:
        >>> accuracy = xm.mesh_reduce("test_accuracy", accuracy, np.mean)   # doctest: +SKIP
    """
    cpu = _to_cpu(data)
    if _world.world_size() == 1:
        return reduce_fn([cpu])
    buffer = io.BytesIO()
    torch.save(cpu, buffer)
    payloads = rendezvous(tag, buffer.getvalue())
    return reduce_fn([torch.load(io.BytesIO(p), weights_only=False) for p in payloads])


def do_on_ordinals(target, data=(), ordinals=(0,)):
    """Runs ``target(*data)`` on the replicas in ``ordinals``, then waits for every replica."""
    result = target(*data) if get_ordinal() in ordinals else None
    rendezvous("torch_xla.core.xla_model.do_on_ordinals")
    return result


# -- saving ----------------------------------------------------------------------------------------


def _to_cpu(data):
    """``data`` with every xshard tensor replaced by a CPU copy (parameters stay parameters)."""
    def move(x):
        if not api.is_device_tensor(x):
            return x
        cpu = api.to_cpu(x.detach())
        if isinstance(x, torch.nn.Parameter):
            return torch.nn.Parameter(cpu, requires_grad=x.requires_grad)
        return cpu

    return pytree.tree_map(move, data)


def save(data, file_or_path, master_only: bool = True, global_master: bool = False) -> None:
    """``torch.save`` of ``data`` with its xshard tensors moved to CPU, so that ``torch.load``
    reads it without xshard. Every replica must call it (they meet afterwards).

    Args:
        data: tensors, possibly in dicts, lists and tuples (e.g. ``model.state_dict()``).
        file_or_path: where to write.
        master_only: write from the master only (else every replica writes).
        global_master: with ``master_only``, the global master writes, not each host's.

    Example:
        >>> xm.save(model.state_dict(), "model.pt")   # doctest: +SKIP
        >>> torch.load("model.pt")                     # plain CPU tensors  # doctest: +SKIP
    """
    should_write = is_master_ordinal(local=not global_master) if master_only else True
    if should_write:
        torch.save(_to_cpu(data), file_or_path)
    if _world.world_size() > 1:
        rendezvous("torch_xla.core.xla_model.save")


# -- random numbers --------------------------------------------------------------------------------

_MASK = (1 << 64) - 1


def get_rng_state(device=None) -> int:
    """The device random stream's state as one int: its seed, plus its position (random ops drawn
    since seeding) times 2**64, so that ``set_rng_state(get_rng_state())`` restores it exactly."""
    _check_device(device)
    seed, counter = struct.unpack("<QQ", bytes(rng.get_state().tolist()))
    return seed | (counter << 64)


def set_rng_state(seed: int, device=None) -> None:
    """Seeds the device random stream (``set_rng_state(s)`` for a seed s < 2**64 starts the
    stream afresh at ``s``; a value from ``get_rng_state`` restores that state).

    Example:
        >>> xm.set_rng_state(1234 + xm.get_ordinal())   # per-replica dropout masks
    """
    _check_device(device)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"set_rng_state needs a non-negative int seed, got {seed!r}.")
    state = struct.pack("<QQ", seed & _MASK, (seed >> 64) & _MASK)
    rng.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


# -- throughput ------------------------------------------------------------------------------------


class RateTracker:
    """Counts things (samples, tokens) and reports how fast they come.

    ``rate()`` is the rate since its previous call, smoothed exponentially with the one before
    (``smooth_factor`` weighs the previous value, default 0.4); ``global_rate()`` is the count since
    construction over the time since construction.

    Example:
        >>> tracker = xm.RateTracker()
        >>> tracker.add(64)
        >>> tracker.global_rate() > 0
        True
    """

    def __init__(self, smooth_factor: float | None = None):
        self.smooth_factor = 0.4 if smooth_factor is None else float(smooth_factor)
        self._start = self._last = time.time()
        self._total = 0.0
        self._since_last = 0.0
        self._rate = None

    def add(self, count) -> None:
        self._total += count
        self._since_last += count

    def rate(self) -> float:
        now = time.time()
        elapsed = now - self._last
        if elapsed <= 0:
            return self._rate or 0.0
        current = self._since_last / elapsed
        if self._rate is not None:
            current = (1 - self.smooth_factor) * current + self.smooth_factor * self._rate
        self._rate, self._last, self._since_last = current, now, 0.0
        return current

    def global_rate(self) -> float:
        elapsed = time.time() - self._start
        return self._total / elapsed if elapsed > 0 else 0.0


# -- names with no meaning here --------------------------------------------------------------------

_NO_MEANING = {
    "set_replication": "XRT's replication set-up; replicas are the processes of xmp.spawn, "
                       "nothing to set",
    "xla_replication_devices": "XRT's replication devices; each replica has one device, "
                               "xm.xla_device()",
    "get_replication_devices": "XRT's replication devices; use xm.xrt_world_size()",
    "get_replication_devices_count": "use xm.xrt_world_size()",
    "xla_real_devices": "xshard has one logical device per process; its physical devices are "
                        "xshard.devices()",
    "reduce_scatter": "not provided: xm.all_reduce, then take this replica's slice "
                      "(t.chunk(xm.xrt_world_size())[xm.get_ordinal()])",
    "all_to_all": "not provided: xm.all_gather, then take this replica's part",
    "collective_permute": "not provided: xm.all_gather, then take the source replica's part",
    "send": "not provided: xm.all_gather (or xm.rendezvous for host bytes)",
    "recv": "not provided: xm.all_gather (or xm.rendezvous for host bytes)",
    "get_stablehlo": "use xshard.debug to see the HLO of pending work",
    "get_stablehlo_bytecode": "use xshard.debug to see the HLO of pending work",
    "unlazy": "use xm.mark_step()",
}


def __getattr__(name: str):
    if name in _NO_MEANING:
        raise AttributeError(f"torch_xla.core.xla_model.{name} has no counterpart in "
                             f"xshard.compat: {_NO_MEANING[name]}.")
    raise AttributeError(f"module 'torch_xla.core.xla_model' (xshard.compat) has no attribute "
                         f"{name!r}")


__all__ = ["REDUCE_SUM", "REDUCE_MUL", "REDUCE_AND", "REDUCE_OR", "REDUCE_MIN", "REDUCE_MAX",
           "xla_device", "xla_device_hw", "get_xla_supported_devices", "xrt_world_size",
           "get_ordinal", "get_local_ordinal", "is_master_ordinal", "master_print",
           "add_step_closure", "mark_step", "wait_device_ops", "optimization_barrier_",
           "all_reduce", "all_gather", "reduce_gradients", "optimizer_step", "rendezvous",
           "mesh_reduce", "do_on_ordinals", "save", "get_rng_state", "set_rng_state",
           "RateTracker"]
