"""``torch_xla.debug.metrics`` (``met``): xshard's counters and timings under PyTorch/XLA's names
(``CompileTime``, ``ExecuteTime``, ``TransferToDeviceTime``, ``TransferFromDeviceTime``,
``TraceTime``; counters such as ``aten::<op>`` for CPU fallbacks, ``UncachedCompile``)."""

from xshard.core.metrics import (clear_all, clear_counters, clear_metrics,  # noqa: F401
                                 counter_names, counter_value, executed_fallback_ops, metric_data,
                                 metric_names, metrics_report, short_metrics_report)

__all__ = ["metrics_report", "short_metrics_report", "counter_names", "counter_value",
           "metric_names", "metric_data", "clear_counters", "clear_metrics", "clear_all",
           "executed_fallback_ops"]
