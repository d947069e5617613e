"""How much memory each device holds for a training step, and how fast the step runs.

Two kinds of figures:

- **compiled** (``analyze_step``): XLA's memory and cost analyses of the pending step, compiled and not
  run. Under ``xshard.compile_only()`` the step needs no data at all, so meshes and models larger than
  the machine (256 virtual CPU devices, billions of parameters) can be studied on one host. These are
  estimates: what XLA's buffer assignment reserves per device for the program.
- **measured** (``live_bytes_per_device``, ``measure_step``): bytes of the device buffers that live
  tensors hold after real steps, and the wall-clock time of a step.

Example:
    >>> with xshard.compile_only():
    ...     with torch.device("meta"):
    ...         model = GPT(cfg)
    ...     model = FSDP(model, mesh=mesh)
    ...     opt = torch.optim.AdamW(model.parameters())
    ...     x = torch.empty(8, 128, dtype=torch.long, device="meta").to(xshard.device())
    ...     model(x, x).backward(); opt.step()
    ...     xshard.memory.abstract_sync()          # optimizer state now exists, as after a step
    ...     opt.zero_grad(); model(x, x).backward(); opt.step()
    ...     m = xshard.memory.analyze_step(model.parameters(), opt, [x])
    >>> m.parameter_bytes, m.peak_bytes, m.flops            # doctest: +SKIP

[Note: attributing arguments]
A step's arguments are the device data its graph reads. A tensor that the step overwrites (a
parameter, an optimizer moment) holds a pending value by the time the step is analysed; the data it
held before, which the step reads, is its cell's ``source`` (see ``xshard.core.tensor.Cell``). So a
graph input belongs to a tensor when it is that tensor's current value or its cell's source. Its
per-device size is the shard size of the payload: ``sharding.shard_shape(padded shape)`` times the
item size, which is exactly what XLA counts in ``argument_size_in_bytes``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Iterable

import numpy as np
import torch

from xshard.core import api, compiler, execute, ir, runtime
from xshard.core.cells import live_cells
from xshard.core.dtypes import to_numpy_dtype

__all__ = ["StepMemory", "StepMeasurement", "analyze_step", "abstract_sync", "live_bytes_per_device",
           "utilization", "measure_step", "format_bytes", "parse_bytes"]


class NoPendingStepError(RuntimeError):
    """``analyze_step`` found no pending work to compile."""


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Per-device figures of one compiled step (bytes unless stated; see ``analyze_step``).

    ``argument_bytes`` is XLA's count of everything the step reads; it is split into
    ``parameter_bytes``, ``optimizer_bytes``, ``input_bytes`` and ``other_argument_bytes`` (buffers,
    gradients carried in, scalars: the rest). ``gradient_bytes`` is the per-device size of the
    parameters' ``.grad`` tensors, wherever they live (outputs of the step, usually).
    ``peak_bytes`` is arguments + outputs + temporaries - aliased (donated) bytes, the total XLA's
    buffer assignment reserves for the step. (``xla_peak_bytes`` is the compiled
    ``peak_memory_in_bytes`` field as the backend reports it; XLA's CPU backend leaves the
    temporaries out of it, so it is kept for reference only.)
    ``flops`` is per device, from XLA's cost analysis of the partitioned program.
    """

    n_devices: int
    argument_bytes: int
    parameter_bytes: int
    optimizer_bytes: int
    input_bytes: int
    other_argument_bytes: int
    output_bytes: int
    gradient_bytes: int
    temp_bytes: int
    alias_bytes: int
    peak_bytes: int
    xla_peak_bytes: int
    flops: float
    compile_seconds: float

    @property
    def state_bytes(self) -> int:
        """Parameters + gradients + optimizer state per device (the model's training state)."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def total_flops(self) -> float:
        """FLOPs of the step summed over its devices."""
        return self.flops * self.n_devices

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["state_bytes"] = self.state_bytes
        return out


def _storages_of(tensors: Iterable) -> list:
    """One tensor per storage among ``tensors`` (device tensors only)."""
    out, seen = [], set()
    for t in tensors:
        if api.is_device_tensor(t) and id(api.storage(t)) not in seen:
            seen.add(id(api.storage(t)))
            out.append(t)
    return out


def _optimizer_tensors(optimizer) -> list:
    if optimizer is None:
        return []
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    out = []
    for state in optimizer.state.values():
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def _as_list(x) -> list:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [x]
    return list(x)


def _shard_bytes(value) -> int:
    """Per-device bytes of a graph input value (jax.Array, ShapeDtypeStruct or numpy scalar)."""
    itemsize = np.dtype(value.dtype).itemsize
    sharding = getattr(value, "sharding", None)
    shape = tuple(value.shape)
    if sharding is not None:
        shape = tuple(sharding.shard_shape(shape))
    return math.prod(shape) * itemsize


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def _devices_of(values) -> int:
    devices = set()
    for v in values:
        sharding = getattr(v, "sharding", None)
        if sharding is not None:
            devices.update(d.id for d in sharding.device_set)
    return max(1, len(devices))


def analyze_step(params=None, optimizer=None, inputs=None) -> StepMemory:
    """Compiles the pending step (what ``xshard.sync()`` would run now) without running it.

    Args:
        params: the model's parameters (e.g. ``model.parameters()``); their data among the step's
            arguments is reported as ``parameter_bytes``, their ``.grad`` as ``gradient_bytes``.
        optimizer: a ``torch.optim.Optimizer``; its state tensors are ``optimizer_bytes``.
        inputs: the batch tensors; reported as ``input_bytes``.

    Returns:
        A ``StepMemory`` of per-device figures. Nothing runs, and no tensor changes: the step is
        still pending afterwards (``sync()`` runs it, reusing the executable unless it was traced
        under ``compile_only()``).

    Raises:
        NoPendingStepError: there is no pending work (trace a step first).

    Example:
        >>> loss = model(x, y); loss.backward(); opt.step()
        >>> m = xshard.memory.analyze_step(model.parameters(), opt, [x, y])
        >>> print(xshard.memory.format_bytes(m.peak_bytes))   # doctest: +SKIP
    """
    params = _as_list(params)
    step = execute.pending_step()
    if not step.cells:
        raise NoPendingStepError(
            "There is no pending work to analyse: trace a training step (forward, backward, "
            "optimizer step) first, and call analyze_step before xshard.sync().")
    g = step.graph
    start = time.perf_counter()
    if execute.runnable(g):  # cached: the sync that follows reuses the executable
        compiled = compiler.executable(g, step.donate).compiled
    else:
        compiled = compiler.compile_graph(g)
    compile_seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()

    # [Note: attributing arguments]
    category = {}
    for name, tensors in (("input", _as_list(inputs)), ("optimizer", _optimizer_tensors(optimizer)),
                          ("parameter", params)):
        for t in _storages_of(tensors):
            for node in api.storage_data(t):
                category[id(node)] = name
    values = compiler.input_values(g)
    sums = {"parameter": 0, "optimizer": 0, "input": 0}
    for node, value in zip(g.inputs, values):
        name = category.get(id(node))
        if name is not None:
            sums[name] += _shard_bytes(value)
    argument_bytes = int(stats.argument_size_in_bytes)
    other = argument_bytes - sum(sums.values())

    gradient_bytes = _gradient_bytes(params, step, compiled)
    output_bytes = int(stats.output_size_in_bytes)
    temp_bytes = int(stats.temp_size_in_bytes)
    alias_bytes = int(stats.alias_size_in_bytes)
    peak = argument_bytes + output_bytes + temp_bytes - alias_bytes
    xla_peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    return StepMemory(
        n_devices=_devices_of(v for v in values if not isinstance(v, np.ndarray)),
        argument_bytes=argument_bytes, parameter_bytes=sums["parameter"],
        optimizer_bytes=sums["optimizer"], input_bytes=sums["input"],
        other_argument_bytes=other, output_bytes=output_bytes, gradient_bytes=gradient_bytes,
        temp_bytes=temp_bytes, alias_bytes=alias_bytes, peak_bytes=peak,
        xla_peak_bytes=xla_peak,
        flops=_flops(compiled), compile_seconds=compile_seconds)


def _gradient_bytes(params, step, compiled) -> int:
    position = {id(c): pos for c, pos in zip(step.cells, step.owners)}
    out_shardings = None
    total = 0
    for grad in _storages_of(p.grad for p in params if isinstance(p, torch.Tensor)):
        cell = api.storage(grad)
        value = cell.value
        if type(value) is ir.PackedData:  # a member of a compiled step's packed state
            member = value.pack.layout.members[value.member]
            total += member.size * np.dtype(member.dtype).itemsize
            continue
        if value.is_data:
            total += _shard_bytes(value.payload)
            continue
        pos = position.get(id(cell))
        if pos is None:
            continue
        if out_shardings is None:
            out_shardings = list(compiled.output_shardings)
        node = step.graph.order[step.graph.outputs[pos]]
        shape = tuple(out_shardings[pos].shard_shape(tuple(node.shape)))
        total += math.prod(shape) * np.dtype(to_numpy_dtype(node.dtype)).itemsize
    return total


def abstract_sync() -> int:
    """Under ``compile_only()``: stands in for a sync, compiling and running nothing.

    Every pending value becomes data without data (a ``jax.ShapeDtypeStruct``) laid out as its
    tensor's annotation says, or replicated when it has none, so the next step traced sees the state
    a real step leaves behind (optimizer state created, gradients present): analyse that step for
    steady-state figures. Unannotated results are assumed replicated (a real sync keeps whatever
    layout XLA chose).

    Returns:
        The number of tensors (storages) settled.

    Raises:
        CompileOnlyError: called outside ``compile_only()``; run ``xshard.sync()`` instead.
    """
    return execute.sync(abstract=True)


def live_bytes_per_device() -> dict[int, int]:
    """Bytes of device buffers held by live xshard tensors, by device (measured, not estimated).

    Keyed by mesh device id (the device's position in ``xshard.devices()``). In a multi-process
    run only this process's devices are listed: another process's buffers are not visible here.

    Each buffer counts once, however many tensors share it; buffers still being computed count as
    soon as they are dispatched. Data-free tensors of ``compile_only()`` hold nothing.

    Example:
        >>> xshard.sync(wait=True)
        >>> max(xshard.memory.live_bytes_per_device().values())   # doctest: +SKIP
    """
    jax = runtime.jax_module()
    totals: dict[int, int] = {runtime.position(d): 0 for d in runtime.local_devices()}
    seen = set()
    for cell in live_cells():
        node = cell.value
        if not node.is_data:
            continue
        for array in ir.arrays_of(node):
            if not isinstance(array, jax.Array) or id(array) in seen or array.is_deleted():
                continue
            seen.add(id(array))
            itemsize = np.dtype(array.dtype).itemsize
            for shard in array.addressable_shards:
                position = runtime.position(shard.device)
                totals[position] = totals.get(position, 0) + math.prod(shard.data.shape) * itemsize
    return totals


def utilization(flops: float, seconds: float, peak_flops_per_device: float,
                n_devices: int = 1) -> float:
    """Hardware FLOP utilisation: ``flops / (seconds * peak_flops_per_device * n_devices)``.

    Args:
        flops: FLOPs of the step over all devices (``StepMemory.total_flops``).
        seconds: the step's wall-clock time.
        peak_flops_per_device: the hardware's peak FLOP/s per device (e.g. 275e12 for a TPU v4
            chip in bf16).
        n_devices: devices the step ran on.
    """
    for name, value in (("seconds", seconds), ("peak_flops_per_device", peak_flops_per_device),
                        ("n_devices", n_devices)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}.")
    return flops / (seconds * peak_flops_per_device * n_devices)


@dataclasses.dataclass(frozen=True)
class StepMeasurement:
    """A step measured by running it (see ``measure_step``)."""

    seconds: float                  # mean wall-clock time of one step (dispatch to completion)
    live_bytes: dict                # device id -> bytes held by live tensors after the last step
    flops: float                    # per device, from XLA's cost analysis of the step's program
    n_devices: int
    utilization: float | None       # None unless a peak FLOP/s was given

    @property
    def max_live_bytes(self) -> int:
        return max(self.live_bytes.values(), default=0)


def measure_step(step_fn: Callable[[], object], n: int = 3, warmup: int = 1,
                 peak_flops_per_device: float | None = None) -> StepMeasurement:
    """Runs ``step_fn`` (one traced training step) ``warmup + n`` times and measures it.

    Each call is followed by ``xshard.sync()``; the timed calls also wait for completion. The first
    warm-up call compiles. FLOPs (per device) come from the executables the last warm-up call ran:
    the programs its syncs run, or a compiled step's (``xshard.compile``).

    Args:
        step_fn: traces one step (forward, backward, optimizer step); its return value is ignored.
        n: timed steps (their mean is reported).
        warmup: untimed steps first (at least 1: the step must compile before it is timed, and the
            second step is the steady state when the optimizer creates its state lazily).
        peak_flops_per_device: the hardware's peak FLOP/s per device, for ``utilization``.

    Example:
        >>> r = xshard.memory.measure_step(lambda: train_step(model, opt, x, y), n=5,
        ...                                peak_flops_per_device=197e12)   # doctest: +SKIP
    """
    if n < 1 or warmup < 1:
        raise ValueError(f"measure_step needs n >= 1 and warmup >= 1, got n={n}, warmup={warmup}.")
    for _ in range(warmup - 1):
        step_fn()
        execute.sync(wait=True)
    with compiler.watching() as runs:  # whatever the last warm-up step runs: syncs, compiled steps
        step_fn()
        execute.sync(wait=True)
    if not runs:
        raise ValueError("measure_step: step_fn ran nothing on the devices (no sync and no "
                         "compiled step); pass a function that runs one training step.")
    flops = sum(map(_flops, runs))
    leaves = runtime.jax_module().tree_util.tree_leaves
    n_devices = max(len({d.id for s in leaves(c.output_shardings) for d in s.device_set})
                    for c in runs)
    del runs
    start = time.perf_counter()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step_fn()
        execute.sync(wait=True)
        times.append(time.perf_counter() - t0)
    seconds = statistics.fmean(times) if times else time.perf_counter() - start
    util = None
    if peak_flops_per_device is not None:
        util = utilization(flops * n_devices, seconds, peak_flops_per_device, n_devices)
    return StepMeasurement(seconds=seconds, live_bytes=live_bytes_per_device(), flops=flops,
                           n_devices=n_devices, utilization=util)


# -- sizes as people write them ----------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3,
          "tib": 1024**4}


def parse_bytes(text: str | int) -> int:
    """``'16GiB'`` -> 17179869184; ``'1.5GB'`` -> 1500000000; plain numbers are bytes."""
    if isinstance(text, (int, np.integer)):
        return int(text)
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("kmgtib")
    unit = raw[len(number):]
    if unit not in _UNITS or not number:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 16GiB, 512MiB, 1.5GB or a "
                         f"number of bytes.")
    try:
        return int(float(number) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 16GiB, 512MiB, 1.5GB or "
                         f"a number of bytes.") from None


def format_bytes(n: float) -> str:
    """Binary units: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
