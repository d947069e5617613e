"""Counters and timings of tracing, compilation, execution, transfers and CPU fallbacks.

Two views of the same events:

- PyTorch/XLA's (``torch_xla.debug.metrics``), by the names its users know: ``metrics_report()``,
  ``short_metrics_report()``, ``counter_names()``, ``counter_value(name)``, ``metric_names()``,
  ``metric_data(name)``, ``clear_counters()``, ``clear_metrics()``, ``clear_all()``,
  ``executed_fallback_ops()``;
- xshard's short one: ``snapshot()``, ``report()``, ``reset()``.

[Note: metrics and counters]
A *counter* is an integer:

- ``UncachedCompile``: graphs compiled (executable cache misses);
- ``CachedCompile``: graphs whose executable came from the cache;
- ``MarkStep``: calls of ``xshard.sync()`` / ``xshard.mark_step()``;
- ``aten::<op>``: calls of ``<op>`` that ran eagerly on CPU (no lowering: the CPU fallback), spelt
  as in PyTorch/XLA, e.g. ``aten::nonzero``.

A *metric* is a series of samples, each ``(time_ns, value)``; it keeps its total number of samples,
their sum (the accumulator) and the last 1024 samples. Every metric here is a duration in
nanoseconds (as in PyTorch/XLA):

- ``TraceTime``: host time from the first op recorded after a sync to the next sync (the time the
  program spends building the step's graph: Python, PyTorch and xshard's recording);
- ``CompileTime``: lowering and compiling one graph (a cache miss);
- ``ExecuteTime``: dispatching one executable. Execution is asynchronous, so this is the host's
  share; device time is in a profiler trace (``xshard.profiler``);
- ``TransferToDeviceTime``: copying one host tensor to the devices (dispatch of the copy);
- ``TransferFromDeviceTime``: reading one value back to the host (waits for the computation).

A counter or metric that is zero or has no samples is inactive: it is not listed, and its value or
data is None, as in PyTorch/XLA.

Example:
    >>> from xshard import metrics as met
    >>> met.counter_value("UncachedCompile"), met.metric_data("CompileTime")[0]  # doctest: +SKIP
    (1, 1)
    >>> print(met.short_metrics_report())  # doctest: +SKIP
    Metric: CompileTime
      TotalSamples: 1
      Accumulator: 152ms334.521us
      Percentiles: 1%=152ms334.521us; 5%=152ms334.521us; ...
    Counter: CachedCompile
      Value: 9
"""

from __future__ import annotations

import collections
import time

MAX_SAMPLES = 1024
_PERCENTILES = (0.01, 0.05, 0.1, 0.2, 0.5, 0.8, 0.9, 0.95, 0.99)
_TIME, _NUMBER = "time", "number"

TRACE_TIME = "TraceTime"
COMPILE_TIME = "CompileTime"
EXECUTE_TIME = "ExecuteTime"
TRANSFER_TO_DEVICE_TIME = "TransferToDeviceTime"
TRANSFER_FROM_DEVICE_TIME = "TransferFromDeviceTime"
UNCACHED_COMPILE = "UncachedCompile"
CACHED_COMPILE = "CachedCompile"
MARK_STEP = "MarkStep"
FALLBACK_PREFIX = "aten::"


class _Metric:
    """The samples of one metric: how many, their sum, and the last ``MAX_SAMPLES`` of them."""

    __slots__ = ("unit", "total", "accumulator", "samples")

    def __init__(self, unit: str):
        self.unit = unit
        self.clear()

    def clear(self) -> None:
        self.total = 0
        self.accumulator = 0.0
        self.samples = collections.deque(maxlen=MAX_SAMPLES)

    def add(self, value: float) -> None:
        self.total += 1
        self.accumulator += value
        self.samples.append((time.time_ns(), value))


class _Metrics:
    """Every counter and metric of this process, plus the totals ``snapshot()`` reports."""

    def __init__(self):
        self.counters: collections.Counter = collections.Counter()
        self.series: dict[str, _Metric] = {}
        self.reset()

    def reset(self):
        self.clear_counters()
        self.clear_metrics()

    def clear_counters(self):
        self.compiles = 0
        self.cache_hits = 0
        self.executions = 0
        self.cpu_fallbacks = collections.Counter()
        self.counters.clear()

    def clear_metrics(self):
        self.compile_seconds = 0.0
        self.execute_seconds = 0.0
        for metric in self.series.values():
            metric.clear()

    def sample(self, name: str, value: float, unit: str = _TIME) -> None:
        metric = self.series.get(name)
        if metric is None:
            metric = self.series[name] = _Metric(unit)
        metric.add(value)

    def record_compile(self, seconds: float):
        self.compiles += 1
        self.compile_seconds += seconds
        self.counters[UNCACHED_COMPILE] += 1
        self.sample(COMPILE_TIME, seconds * 1e9)

    def record_cache_hit(self):
        self.cache_hits += 1
        self.counters[CACHED_COMPILE] += 1

    def record_execute(self, seconds: float):
        self.executions += 1
        self.execute_seconds += seconds
        self.sample(EXECUTE_TIME, seconds * 1e9)


METRICS = _Metrics()


# -- recording (called by the core) ----------------------------------------------------------------


def count_fallback(op_name: str) -> None:
    """Counts one CPU-fallback call of ``op_name`` (``str(func)``: ``aten.nonzero.default``)."""
    METRICS.cpu_fallbacks[op_name] += 1
    namespace, _, rest = op_name.partition(".")
    METRICS.counters[f"{namespace}::{rest.partition('.')[0]}"] += 1


def count(name: str, n: int = 1) -> None:
    """Adds ``n`` to counter ``name``."""
    METRICS.counters[name] += n


def record_cache_hit() -> None:
    METRICS.record_cache_hit()


def record_compile(seconds: float) -> None:
    METRICS.record_compile(seconds)


def record_execute(seconds: float) -> None:
    METRICS.record_execute(seconds)


def record_trace(seconds: float) -> None:
    METRICS.sample(TRACE_TIME, seconds * 1e9)


def record_transfer_to_device(seconds: float) -> None:
    METRICS.sample(TRANSFER_TO_DEVICE_TIME, seconds * 1e9)


def record_transfer_from_device(seconds: float) -> None:
    METRICS.sample(TRANSFER_FROM_DEVICE_TIME, seconds * 1e9)


# -- PyTorch/XLA's interface -----------------------------------------------------------------------


def _check_name(name, what: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{what} names are strings, e.g. 'CompileTime' or 'aten::nonzero'; got "
                        f"{name!r} ({type(name).__name__}).")


def counter_names() -> list[str]:
    """The names of the active (non-zero) counters, sorted.

    Returns:
        e.g. ``['CachedCompile', 'MarkStep', 'UncachedCompile', 'aten::nonzero']``.
    """
    return sorted(name for name, value in METRICS.counters.items() if value > 0)


def counter_value(name: str) -> int | None:
    """The value of counter ``name``, or None if it is inactive (zero or never counted).

    Args:
        name: a counter name (see ``counter_names()``), e.g. ``'UncachedCompile'``.

    Returns:
        An int, or None.

    Example:
        >>> xshard.metrics.counter_value("aten::nonzero")  # doctest: +SKIP
        3
    """
    _check_name(name, "Counter")
    value = METRICS.counters.get(name, 0)
    return value if value > 0 else None


def metric_names() -> list[str]:
    """The names of the active metrics (with at least one sample), sorted."""
    return sorted(name for name, metric in METRICS.series.items() if metric.total > 0)


def metric_data(name: str):
    """The data of metric ``name``, or None if it has no samples.

    Args:
        name: a metric name (see ``metric_names()``), e.g. ``'CompileTime'``.

    Returns:
        ``(total_samples, accumulator, samples)``: how many samples were ever added, their sum
        (nanoseconds for the time metrics), and the last 1024 samples as ``(time_ns, value)``.

    Example:
        >>> compiles, total_ns, _ = xshard.metrics.metric_data("CompileTime")  # doctest: +SKIP
    """
    _check_name(name, "Metric")
    metric = METRICS.series.get(name)
    if metric is None or metric.total == 0:
        return None
    return metric.total, metric.accumulator, list(metric.samples)


def clear_counters() -> None:
    """Sets every counter to zero (the executable cache is kept)."""
    METRICS.clear_counters()


def clear_metrics() -> None:
    """Drops every metric's samples and sums."""
    METRICS.clear_metrics()


def clear_all() -> None:
    """Clears every counter and every metric."""
    METRICS.reset()


def executed_fallback_ops() -> list[str]:
    """The ops that ran through the CPU fallback since counters were cleared, e.g.
    ``['aten::nonzero']`` (sorted)."""
    return [name for name in counter_names() if name.startswith(FALLBACK_PREFIX)]


def format_time(ns: float) -> str:
    """A duration in nanoseconds as PyTorch/XLA prints it: ``06m09s401ms746.001us``.

    Units from the largest non-zero one down to milliseconds are zero-padded integers (days, hours,
    minutes, seconds: 2 digits; milliseconds: 3), microseconds have 3 decimals.
    """
    ns = max(float(ns), 0.0)
    parts = []
    for suffix, scale, width in (("d", 86400e9, 2), ("h", 3600e9, 2), ("m", 60e9, 2),
                                 ("s", 1e9, 2), ("ms", 1e6, 3)):
        whole = int(ns // scale)
        if whole or parts:
            parts.append(f"{whole:0{width}d}{suffix}")
            ns -= whole * scale
    parts.append(f"{ns / 1e3:07.3f}us")
    return "".join(parts)


def _format_value(metric: _Metric, value: float) -> str:
    return format_time(value) if metric.unit == _TIME else f"{value:.2f}"


def _metric_text(name: str, metric: _Metric) -> str:
    samples = list(metric.samples)
    lines = [f"Metric: {name}", f"  TotalSamples: {metric.total}",
             f"  Accumulator: {_format_value(metric, metric.accumulator)}"]
    if len(samples) > 1:
        seconds = (samples[-1][0] - samples[0][0]) / 1e9
        if seconds > 0:
            lines.append(f"  ValueRate: "
                         f"{_format_value(metric, sum(v for _, v in samples) / seconds)} / second")
            lines.append(f"  Rate: {len(samples) / seconds:g} / second")
    values = sorted(v for _, v in samples)
    if values:
        lines.append("  Percentiles: " + "; ".join(
            f"{p * 100:g}%={_format_value(metric, values[int(p * len(values))])}"
            for p in _PERCENTILES))
    return "\n".join(lines) + "\n"


def _counter_text(name: str, value: int) -> str:
    return f"Counter: {name}\n  Value: {value}\n"


def metrics_report() -> str:
    """Every active metric and counter, in PyTorch/XLA's text format.

    Each metric reads ``Metric: <name>`` followed by indented ``TotalSamples``, ``Accumulator``,
    ``ValueRate`` and ``Rate`` (with two samples or more) and ``Percentiles`` lines; each counter
    ``Counter: <name>`` and ``  Value: <n>``. Metrics come first, each group sorted by name.

    Returns:
        The report (a str), empty when nothing is active.

    Example:
        >>> print(xshard.metrics.metrics_report())  # doctest: +SKIP
    """
    out = [_metric_text(name, METRICS.series[name]) for name in metric_names()]
    out += [_counter_text(name, METRICS.counters[name]) for name in counter_names()]
    return "".join(out)


_SHORT_COUNTERS = ("CachedCompile", "MarkStep")
_SHORT_METRICS = ("CompileTime", "ExecuteTime", "ExecuteReplicatedTime", "TransferToDeviceTime",
                  "TransferFromDeviceTime")


def short_metrics_report(counter_names: list | None = None,
                         metric_names: list | None = None) -> str:
    """The named metrics and counters (if active), then every CPU-fallback counter (``aten::``).

    Args:
        counter_names: counters to show (default ``['CachedCompile', 'MarkStep']``).
        metric_names: metrics to show (default ``['CompileTime', 'ExecuteTime',
            'ExecuteReplicatedTime', 'TransferToDeviceTime', 'TransferFromDeviceTime']``).

    Returns:
        The report in ``metrics_report()``'s format.

    Example:
        >>> print(xshard.metrics.short_metrics_report(metric_names=["TraceTime"]))  # doctest: +SKIP
    """
    counters = _names(counter_names, _SHORT_COUNTERS, "counter_names")
    metrics = _names(metric_names, _SHORT_METRICS, "metric_names")
    out = []
    for name in metrics:
        metric = METRICS.series.get(name)
        if metric is not None and metric.total > 0:
            out.append(_metric_text(name, metric))
    for name in counters:
        if METRICS.counters.get(name, 0) > 0:
            out.append(_counter_text(name, METRICS.counters[name]))
    out += [_counter_text(name, METRICS.counters[name]) for name in executed_fallback_ops()]
    return "".join(out)


def _names(given, default, argument: str) -> tuple:
    if not given:  # PyTorch/XLA treats None and [] alike: the defaults
        return default
    if isinstance(given, str) or not all(isinstance(n, str) for n in given):
        raise TypeError(f"{argument} must be a list of names, e.g. ['CompileTime']; got {given!r}.")
    return tuple(given)


# -- xshard's short view ---------------------------------------------------------------------------


def snapshot() -> dict:
    """A copy of the counters.

    Returns:
        A dict with ``compiles``, ``cache_hits``, ``executions`` (ints), ``compile_seconds``,
        ``execute_seconds`` (dispatch time; execution itself is asynchronous) and ``cpu_fallbacks``
        (a dict op name -> count).

    Example:
        >>> snap = xshard.metrics.snapshot()
        >>> snap["compiles"], snap["cache_hits"], snap["cpu_fallbacks"]  # doctest: +SKIP
        (1, 9, {})
    """
    m = METRICS
    return {
        "compiles": m.compiles,
        "cache_hits": m.cache_hits,
        "executions": m.executions,
        "compile_seconds": m.compile_seconds,
        "execute_seconds": m.execute_seconds,
        "cpu_fallbacks": dict(m.cpu_fallbacks),
    }


def reset() -> None:
    """Sets every counter and metric back to zero (the executable cache is kept)."""
    METRICS.reset()


def report() -> str:
    """A readable summary of the counters and timings."""
    m = METRICS

    def each(name, digits):  # over the metric's own samples: counters and metrics clear apart
        metric = m.series.get(name)
        if metric is None or not metric.total:
            return ")"
        return f", {metric.accumulator / metric.total / 1e6:.{digits}f} ms each)"

    lines = [
        f"compiles:        {m.compiles} ({m.compile_seconds:.3f} s total" + each(COMPILE_TIME, 1),
        f"cache hits:      {m.cache_hits}",
        f"executions:      {m.executions} ({m.execute_seconds * 1e3:.1f} ms dispatching"
        + each(EXECUTE_TIME, 2),
    ]
    if m.cpu_fallbacks:
        lines.append("cpu fallbacks:")
        lines.extend(f"  {op}: {n}" for op, n in m.cpu_fallbacks.most_common())
    else:
        lines.append("cpu fallbacks:   none")
    return "\n".join(lines)
