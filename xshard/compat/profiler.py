"""``torch_xla.debug.profiler`` (``xp``): xshard's profiler under PyTorch/XLA's names."""

from xshard.profiler import (StepTrace, Trace, get_tracer_marked_step,  # noqa: F401
                             set_tracer_marked_step, start_server, start_trace, stop_server,
                             stop_trace, trace, trace_detached, trace_me)
from xshard.profiler import __all__  # noqa: F401
