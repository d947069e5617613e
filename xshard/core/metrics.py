"""Counters and timings of compilation, execution and CPU fallbacks.

Example:
    >>> snap = xshard.metrics.snapshot()
    >>> snap["compiles"], snap["cache_hits"], snap["cpu_fallbacks"]  # doctest: +SKIP
    (1, 9, {})
"""

from __future__ import annotations

import collections


class _Metrics:
    def __init__(self):
        self.reset()

    def reset(self):
        self.compiles = 0
        self.cache_hits = 0
        self.executions = 0
        self.compile_seconds = 0.0
        self.execute_seconds = 0.0
        self.cpu_fallbacks = collections.Counter()

    def record_compile(self, seconds: float):
        self.compiles += 1
        self.compile_seconds += seconds

    def record_execute(self, seconds: float):
        self.executions += 1
        self.execute_seconds += seconds


METRICS = _Metrics()


def count_fallback(op_name: str) -> None:
    METRICS.cpu_fallbacks[op_name] += 1


def snapshot() -> dict:
    """A copy of the counters.

    Returns:
        A dict with ``compiles``, ``cache_hits``, ``executions`` (ints), ``compile_seconds``,
        ``execute_seconds`` (dispatch time; execution itself is asynchronous) and ``cpu_fallbacks``
        (a dict op name -> count).
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
    """Sets every counter back to zero (the executable cache is kept)."""
    METRICS.reset()


def report() -> str:
    """A readable summary of the counters and timings."""
    m = METRICS
    lines = [
        f"compiles:        {m.compiles} ({m.compile_seconds:.3f} s total"
        + (f", {m.compile_seconds / m.compiles * 1e3:.1f} ms each)" if m.compiles else ")"),
        f"cache hits:      {m.cache_hits}",
        f"executions:      {m.executions} ({m.execute_seconds * 1e3:.1f} ms dispatching"
        + (f", {m.execute_seconds / m.executions * 1e3:.2f} ms each)" if m.executions else ")"),
    ]
    if m.cpu_fallbacks:
        lines.append("cpu fallbacks:")
        lines.extend(f"  {op}: {n}" for op, n in m.cpu_fallbacks.most_common())
    else:
        lines.append("cpu fallbacks:   none")
    return "\n".join(lines)
