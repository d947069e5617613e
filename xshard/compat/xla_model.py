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

import contextlib
import io
import numbers
import os
import struct
import sys
import time

import torch
import torch.utils._pytree as pytree

import xshard
from xshard import memory
from xshard.compat import _world, collectives
from xshard.core import api, distributed, rng, runtime
from xshard.spmd import loader

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


def xla_device_kind(device=None) -> str:
    """The kind of the physical devices behind ``device`` (JAX's ``device_kind``, e.g. ``'cpu'``
    or ``'TPU v4'``)."""
    _check_device(device)
    return runtime.local_devices()[0].device_kind


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


def _check_groups(groups, what: str, ordered: bool = True) -> None:
    """``groups`` must be None or ``[]`` (torch_xla's spellings of every replica) or one group of
    every replica; ``ordered``: in ordinal order (the blocks of a gather or scatter follow the
    order of the group, which xshard does not reorder)."""
    if groups is None or (isinstance(groups, (list, tuple)) and len(groups) == 0):
        return
    n = _world.world_size()
    ok = isinstance(groups, (list, tuple)) and all(isinstance(g, (list, tuple)) for g in groups)
    flat = sorted(r for g in groups for r in g) if ok else None
    if flat == list(range(n)) and len(groups) == 1:
        if ordered and list(groups[0]) != flat:
            raise NotImplementedError(
                f"{what}(groups={groups!r}): the group lists the replicas out of ordinal order, "
                f"which would order the blocks by position in the group; xshard orders them by "
                f"ordinal. Pass groups=None (or {[flat]!r}) and reorder the result yourself.")
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


def _check_scale(scale, tensors: list, what: str) -> float:
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"scale must be a number, got {type(scale).__name__}.")
    if scale != 1.0:
        for t in tensors:
            if not t.dtype.is_floating_point:
                raise ValueError(f"{what}(scale={scale!r}) of a {t.dtype} tensor: a scale "
                                 f"applies to floating-point tensors only; pass scale=1.0.")
    return float(scale)


def all_reduce(reduce_type: str, inputs, scale: float = 1.0, groups=None,
               pin_layout: bool = True):
    """Reduces ``inputs`` across the replicas (``reduce_type``: ``xm.REDUCE_SUM``, ...), then
    multiplies by ``scale``.

    Args:
        reduce_type: ``REDUCE_SUM``, ``REDUCE_MUL``, ``REDUCE_AND``, ``REDUCE_OR``,
            ``REDUCE_MIN`` or ``REDUCE_MAX``.
        inputs: one xshard tensor, or a list of them (reduced in place, one collective per dtype).
        scale: a factor applied to the result (floating-point tensors; 1.0 for the others).
        groups: None or ``[]`` (all replicas), or one group of every replica, in any order.
        pin_layout: accepted for compatibility.

    Returns:
        For a tensor: a new tensor with the result. For a list: the same list, its tensors now
        holding the results.

    Example:
        >>> total = xm.all_reduce(xm.REDUCE_SUM, correct)          # doctest: +SKIP
        >>> xm.all_reduce(xm.REDUCE_SUM, grads, scale=1.0 / xm.xrt_world_size())  # doctest: +SKIP
    """
    _check_reduce_type(reduce_type)
    _check_groups(groups, "xm.all_reduce", ordered=False)
    single = isinstance(inputs, torch.Tensor)
    if not single and not isinstance(inputs, (list, tuple)):
        raise TypeError(f"xm.all_reduce needs an xshard tensor or a list of them, got "
                        f"{type(inputs).__name__} {inputs!r}; for a Python number, reduce "
                        f"torch.tensor(value, device=xm.xla_device()), or use xm.mesh_reduce.")
    tensors = [inputs] if single else list(inputs)
    _check_device_tensors(tensors, "xm.all_reduce")
    scale = _check_scale(scale, tensors, "xm.all_reduce")
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
    """The replicas' values of ``value`` concatenated along ``dim``, in ordinal order; for a list
    of tensors (torch_xla's coalesced form), the list of their gathers.

    Example:
        >>> everyone = xm.all_gather(predictions)     # (world * batch, ...)  # doctest: +SKIP
    """
    if isinstance(value, (list, tuple)) and output is None:
        return [all_gather(v, dim, groups, None, pin_layout) for v in value]
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


def _int(value, name: str) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}.")
    return int(value)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _dim(t: torch.Tensor, dim, name: str) -> int:
    """``dim`` of ``t`` as a non-negative int, or a clear error."""
    dim = _int(dim, name)
    if t.dim() == 0 or not -t.dim() <= dim < t.dim():
        raise ValueError(f"{name}={dim} is out of range for a {t.dim()}-dim tensor of shape "
                         f"{list(t.shape)}; valid: -{t.dim()} to {t.dim() - 1}.")
    return dim % t.dim()


def _check_count(count, name: str, what: str) -> int:
    n = _world.world_size()
    if _int(count, name) != n:
        raise ValueError(f"{what}({name}={count}): {name} must be the number of replicas, {n} "
                         f"(xm.xrt_world_size()); groups of fewer replicas are not supported.")
    return n


def _check_divides(t: torch.Tensor, dim: int, n: int, what: str) -> None:
    if t.shape[dim] % n:
        raise ValueError(f"{what}: dimension {dim} of a tensor of shape {list(t.shape)} has size "
                         f"{t.shape[dim]}, not a multiple of the {n} replicas; pad it to a "
                         f"multiple of {n}.")


def _put(results: list, output, tensors: list, what: str):
    """``results`` (data nodes) as new tensors, or written into ``output`` (a tensor, or a list of
    as many) after checking its shapes and dtypes."""
    if output is None:
        return [api.new_tensor(node) for node in results]
    outputs = [output] if isinstance(output, torch.Tensor) else output
    if not isinstance(outputs, (list, tuple)) or len(outputs) != len(results):
        raise TypeError(f"{what}(output=...) must be a tensor for a tensor input, or a list of "
                        f"{len(results)} tensors for a list input; got {type(output).__name__}.")
    _check_device_tensors(outputs, f"{what} output")
    for i, (o, node, t) in enumerate(zip(outputs, results, tensors)):
        if tuple(o.shape) != tuple(node.shape) or o.dtype != t.dtype:
            raise ValueError(f"{what}: output {i} is {list(o.shape)} {o.dtype}; the result is "
                             f"{list(node.shape)} {t.dtype}.")
    for o, node in zip(outputs, results):
        api.write(o, node)
    return list(outputs)


def reduce_scatter(reduce_type: str, input, scale: float, scatter_dim: int, shard_count: int,
                   groups=None, output=None, pin_layout: bool = True):
    """Reduces ``input`` across the replicas, times ``scale``, and gives each replica its block
    of the result along ``scatter_dim``: replica r gets the r-th of ``shard_count`` equal blocks.

    Args:
        reduce_type: as in ``all_reduce``.
        input: an xshard tensor, or a list of them (one collective for all).
        scale: a factor applied to the result (floating-point tensors; 1.0 for the others).
        scatter_dim: the dimension split into blocks; its size must be a multiple of
            ``shard_count``.
        shard_count: the number of replicas (``xm.xrt_world_size()``).
        groups: None (all replicas).
        output: None, or a tensor (a list for a list input) of the result's shape and dtype to
            write into.
        pin_layout: accepted for compatibility.

    Returns:
        A tensor (a list of tensors for a list input) with ``input``'s shape, ``scatter_dim``
        divided by ``shard_count``; ``output`` when given.

    Example:
        >>> n = xm.xrt_world_size()
        >>> shard = xm.reduce_scatter(xm.REDUCE_SUM, grad, 1.0 / n, 0, n)  # doctest: +SKIP
    """
    what = "xm.reduce_scatter"
    op = _check_reduce_type(reduce_type)
    _check_groups(groups, what)
    single = isinstance(input, torch.Tensor)
    if not single and not (isinstance(input, (list, tuple)) and input):
        raise TypeError(f"{what} needs an xshard tensor or a non-empty list of them, got "
                        f"{type(input).__name__}.")
    tensors = [input] if single else list(input)
    _check_device_tensors(tensors, what)
    scale = _check_scale(scale, tensors, what)
    n = _check_count(shard_count, "shard_count", what)
    dims = tuple(_dim(t, scatter_dim, "scatter_dim") for t in tensors)  # per tensor's rank
    for t, dim in zip(tensors, dims):
        _check_divides(t, dim, n, what)
    shapes = [[s // n if d == dim else s for d, s in enumerate(t.shape)]
              for t, dim in zip(tensors, dims)]
    with torch.no_grad():
        if n == 1:
            results = [api.value(t * scale if scale != 1.0 else t.clone()) for t in tensors]
        else:
            results = collectives.run("reduce_scatter", (op, scale, dims), tensors, shapes)
        out = _put(results, output, tensors, what)
    return out[0] if single else out


def all_to_all(value: torch.Tensor, split_dimension: int, concat_dimension: int,
               split_count: int, groups=None, pin_layout: bool = True) -> torch.Tensor:
    """Splits ``value`` along ``split_dimension`` into ``split_count`` blocks, sends block j to
    replica j, and concatenates the blocks received along ``concat_dimension``, in replica order.

    Example:
        >>> mine = xm.all_to_all(x, 0, 0, xm.xrt_world_size())   # doctest: +SKIP
    """
    what = "xm.all_to_all"
    _check_groups(groups, what)
    _check_device_tensors([value], what)
    split = _dim(value, split_dimension, "split_dimension")
    concat = _dim(value, concat_dimension, "concat_dimension")
    n = _check_count(split_count, "split_count", what)
    _check_divides(value, split, n, what)
    shape = list(value.shape)
    shape[split] //= n
    shape[concat] *= n
    with torch.no_grad():
        if n == 1:
            return value.clone()
        (result,) = collectives.run("all_to_all", (split, concat), [value], [shape])
        return api.new_tensor(result)


def collective_permute(value: torch.Tensor, pairs) -> torch.Tensor:
    """Sends ``value`` from replica ``source`` to replica ``target`` for each ``(source, target)``
    in ``pairs``; a replica that is no pair's target gets zeros.

    Example:
        >>> ring = [(r, (r + 1) % xm.xrt_world_size()) for r in range(xm.xrt_world_size())]
        >>> from_left = xm.collective_permute(x, ring)  # doctest: +SKIP
    """
    what = "xm.collective_permute"
    _check_device_tensors([value], what)
    n = _world.world_size()
    given = pairs
    try:
        pairs = tuple(tuple(p) for p in pairs)
    except TypeError:
        pairs = None
    if pairs is None or not all(len(p) == 2 and all(map(_is_int, p)) for p in pairs):
        raise TypeError(f"{what}: pairs must be a list of (source, target) replica ordinals, "
                        f"e.g. [[0, 1], [1, 0]]; got {given!r}.")
    pairs = tuple((int(s), int(t)) for s, t in pairs)
    for s, t in pairs:
        if not (0 <= s < n and 0 <= t < n):
            raise ValueError(f"{what}: pair {(s, t)} names a replica outside 0..{n - 1} (there "
                             f"are {n} replicas).")
    for k, name in ((0, "source"), (1, "target")):
        seen = [p[k] for p in pairs]
        if len(set(seen)) != len(seen):
            raise ValueError(f"{what}: pairs {list(pairs)} name a {name} more than once; each "
                             f"replica sends at most once and receives at most once.")
    with torch.no_grad():
        if n == 1:
            return value.clone() if pairs else torch.zeros_like(value)
        (result,) = collectives.run("collective_permute", (pairs,), [value],
                                       [list(value.shape)])
        return api.new_tensor(result)


def collective_broadcast(tensors, root_ordinal: int = 0, groups=None,
                         pin_layout: bool = True) -> None:
    """Sets each tensor in ``tensors`` (in place) to its value on replica ``root_ordinal``.

    Example:
        >>> xm.collective_broadcast(list(model.parameters()))   # doctest: +SKIP
    """
    what = "xm.collective_broadcast"
    _check_groups(groups, what, ordered=False)
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    _check_device_tensors(tensors, what)
    n = _world.world_size()
    if not 0 <= _int(root_ordinal, "root_ordinal") < n:
        raise ValueError(f"{what}(root_ordinal={root_ordinal}): valid ordinals are 0 to {n - 1}.")
    if n == 1 or not tensors:
        return
    with torch.no_grad():
        results = collectives.run("collective_broadcast", (root_ordinal,), tensors,
                                     [list(t.shape) for t in tensors])
        for t, node in zip(tensors, results):
            api.write(t, node)


def broadcast_master_param(model: torch.nn.Module) -> None:
    """Sets every parameter and buffer of ``model`` to replica 0's (each replica builds its own
    model: one initialised without a seed differs between them).

    Example:
        >>> xm.broadcast_master_param(model)   # doctest: +SKIP
    """
    collective_broadcast(list(model.parameters()) + list(model.buffers()))
    mark_step()


def _fetch_gradients(optimizer) -> list:
    """The gradients of ``optimizer``'s parameters that have one (torch_xla's AMP examples call
    it to check them for inf / NaN)."""
    return [p.grad for group in optimizer.param_groups for p in group["params"]
            if p.grad is not None]


def reduce_gradients(optimizer, groups=None, pin_layout: bool = True) -> None:
    """Averages the gradients of ``optimizer``'s parameters across the replicas (a sum times
    1/world size, one collective per dtype). Nothing happens with one replica."""
    count = _world.world_size()
    if count > 1:
        all_reduce(REDUCE_SUM, _fetch_gradients(optimizer), scale=1.0 / count, groups=groups)


def is_xla_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is on the (xshard) device."""
    return api.is_device_tensor(tensor)


def send_cpu_data_to_device(datas, device, input_sharding=None):
    """``datas`` (CPU tensors, possibly in tuples, lists, dicts, dataclasses) copied to
    ``device``, as ``xshard.spmd.send_cpu_data_to_device`` does."""
    return loader.send_cpu_data_to_device(datas, device, input_sharding)


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
        if distributed.num_processes() > 1:
            # One program over several processes (python -m xshard.launch): one replica, whose
            # processes still meet (a file process 0 wrote is there for all after the meeting).
            collectives.exchange_objects(str(tag), b"")
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
    """Runs ``target(*data)`` on the replicas in ``ordinals``, with ``data``'s tensors moved to
    CPU, then waits for every replica. Returns ``target``'s result there, None elsewhere.

    Example:
        >>> xm.do_on_ordinals(lambda w: print(w.sum()), (model.weight,))   # doctest: +SKIP
    """
    result = target(*_to_cpu(data)) if get_ordinal() in ordinals else None
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
    # Every process reads, as torch_xla's save does: in one program over several processes a
    # read of a sharded value is a collective all of them take part in.
    cpu = _to_cpu(data)
    if should_write:
        torch.save(cpu, file_or_path)
    if _world.world_size() > 1 or distributed.num_processes() > 1:
        rendezvous("torch_xla.core.xla_model.save")


# -- random numbers --------------------------------------------------------------------------------


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
    if not _is_int(seed) or not 0 <= seed < 2 ** 128:
        raise ValueError(f"set_rng_state needs an int seed from 0 to 2**128 - 1 (a seed below "
                         f"2**64, or a value from get_rng_state), got {seed!r}.")
    seed = int(seed)
    state = struct.pack("<QQ", seed & rng.MASK, (seed >> 64) & rng.MASK)
    rng.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


@contextlib.contextmanager
def fork_rng(device=None, enabled: bool = True):
    """Context manager: random ops inside draw from the device stream, which is put back as it
    was on exit, so the code after it draws what it would have drawn without the block.

    Args:
        device: None or this process's device.
        enabled: False makes it do nothing (to switch it off without re-indenting).

    Example:
        >>> with xm.fork_rng():
        ...     noise = torch.randn(4, device=xm.xla_device())   # the outer stream is untouched
    """
    if not enabled:
        yield
        return
    state = get_rng_state(device)
    try:
        yield
    finally:
        set_rng_state(state, device)


def get_memory_info(device=None) -> dict:
    """Memory of the busiest of this process's physical devices behind ``xshard:0``, in bytes.

    Returns a dict with ``bytes_used`` and ``bytes_limit``, and ``peak_bytes_used`` where the
    runtime keeps a peak (GPU and TPU do). Pending work is dispatched first. On CPU devices, which
    report nothing, ``bytes_used`` counts the buffers of live xshard tensors on the device
    (``xshard.memory.live_bytes_per_device``) and ``bytes_limit`` is the host's memory shared
    evenly among its devices.

    Example:
        >>> info = xm.get_memory_info()
        >>> info["bytes_used"] <= info["bytes_limit"]
        True
    """
    _check_device(device)
    xshard.sync()
    devices = runtime.local_devices()
    stats = [d.memory_stats() for d in devices]
    if all(s is not None for s in stats):
        busiest = max(stats, key=lambda s: s.get("bytes_in_use", 0))
        info = {"bytes_used": int(busiest.get("bytes_in_use", 0)),
                "bytes_limit": int(busiest.get("bytes_limit", 0))}
        if "peak_bytes_in_use" in busiest:
            info["peak_bytes_used"] = int(busiest["peak_bytes_in_use"])
        return info
    used = memory.live_bytes_per_device()
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"bytes_used": max(used.values(), default=0), "bytes_limit": host // len(devices)}


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
    "send": "XLA's channel send has no JAX counterpart; use xm.collective_permute (or "
            "xm.rendezvous for host bytes)",
    "recv": "XLA's channel recv has no JAX counterpart; use xm.collective_permute (or "
            "xm.rendezvous for host bytes)",
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
           "xla_device", "xla_device_hw", "xla_device_kind", "get_xla_supported_devices",
           "xrt_world_size",
           "get_ordinal", "get_local_ordinal", "is_master_ordinal", "master_print",
           "add_step_closure", "mark_step", "wait_device_ops", "optimization_barrier_",
           "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute",
           "collective_broadcast", "broadcast_master_param", "reduce_gradients",
           "is_xla_tensor", "send_cpu_data_to_device",
           "optimizer_step", "rendezvous",
           "mesh_reduce", "do_on_ordinals", "save", "get_rng_state", "set_rng_state",
           "fork_rng", "get_memory_info", "RateTracker"]
