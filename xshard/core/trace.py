"""xshard's own work as named spans on a profiler timeline, names for its executables, and the
``XSHARD_DEBUG`` report. The public side is ``xshard.profiler``; the core calls the hooks here.

[Note: spans of xshard's phases]
While a profiler trace is active (``xshard.profiler.start_trace``, or a capture through
``xshard.profiler.start_server``), xshard marks its work on the host timeline with jax's TraceMe
spans (``jax.profiler.TraceAnnotation``):

- ``xshard.record``: recording ops: the program's Python, PyTorch's dispatch, xshard's IR building;
- ``xshard.sync``: one sync, holding ``xshard.build_graph``, ``xshard.compile`` (a cache miss:
  lowering and XLA compilation) and ``xshard.execute`` (dispatching the executable; inside it jax's
  own ``PjitFunction(jit(xshard_<program>_<n>))`` event names the program, see ``program_name``);
- ``xshard.transfer_to_device`` / ``xshard.transfer_from_device``: copies between host and devices.

Spans on one thread must nest, or trace viewers misdraw them. A single recording span per step
would start at the step's first op and end at its sync, straddling the user's ``Trace`` spans and
xshard's transfers. So the start and end of every other span is a *boundary*: it closes the open
recording span, and the next recorded op opens a new one. The recording spans tile the time spent
recording, each inside the innermost span around it.

The durations are also metrics (``xshard.core.metrics``): ``TraceTime`` runs from the first op
recorded after a sync to the next sync; the phases record ``CompileTime``, ``ExecuteTime``,
``TransferToDeviceTime`` and ``TransferFromDeviceTime``, traced or not.

Ops may be recorded on more than one thread (PyTorch runs a backward pass for a non-CPU device on
its autograd thread), and a span belongs to the thread that opened it; so while a trace is active
every op checks that the open recording span is its thread's, else ends it and opens its own.

Cost when no trace is active: each recorded op reads one module global (``OPEN``); only the first
op after a boundary calls ``recording_op()``. While tracing, every op calls it. A phase costs
under 1 µs, once per sync, compile or transfer, never per op (``benchmarks/bench_profiler.py``).
"""

from __future__ import annotations

import functools
import itertools
import linecache
import os
import re
import sys
import threading
import time
import weakref

import torch

from xshard.core import metrics, runtime

jax = runtime.jax_module()

_Span = jax.profiler.TraceAnnotation
_tracing = _Span.is_enabled  # whether a profiler session is collecting now

DEBUG = runtime.debug_enabled()

# -- recording spans and TraceTime -----------------------------------------------------------------

_NOT_TRACING = object()
OPEN = None  # None: the next recorded op calls recording_op(); _NOT_TRACING: no op needs to
_span = None  # the open recording span, and the thread that opened it
_span_thread = None
_recording_since = None  # perf_counter() of the first op recorded since the last sync
_thread_id = threading.get_ident


def recording_op() -> None:
    """An op is being recorded: the first after a boundary, or any while tracing."""
    global OPEN, _recording_since, _span, _span_thread
    if _recording_since is None:
        _recording_since = time.perf_counter()
    if not _tracing():
        boundary()
        OPEN = _NOT_TRACING
        return
    thread = _thread_id()
    if _span is None or _span_thread != thread:
        boundary()
        _span = _Span("xshard.record")
        _span.__enter__()
        _span_thread = thread


def boundary() -> None:
    """Closes the open recording span: another span starts or ends here (see the Note)."""
    global OPEN, _span
    OPEN = None
    span, _span = _span, None
    if span is not None:
        span.__exit__(None, None, None)


def end_recording() -> None:
    """A sync: the ops recorded since the last one are now a graph (one ``TraceTime`` sample)."""
    global _recording_since
    boundary()
    if _recording_since is not None:
        metrics.record_trace(time.perf_counter() - _recording_since)
        _recording_since = None


# -- phases ----------------------------------------------------------------------------------------


class Phase:
    """One kind of xshard work: its span's name, and the metric recording its duration (seconds)."""

    __slots__ = ("name", "record", "ends_recording", "last_seconds")

    def __init__(self, name: str, record=None, ends_recording: bool = False):
        self.name = name
        self.record = record
        self.ends_recording = ends_recording
        self.last_seconds = 0.0


class _InPhase:
    __slots__ = ("phase", "span", "start")

    def __init__(self, phase: Phase):
        self.phase = phase

    def __enter__(self):
        if self.phase.ends_recording:
            end_recording()
        else:
            boundary()
        self.span = None
        if _tracing():
            self.span = _Span(self.phase.name)
            self.span.__enter__()
        self.start = time.perf_counter()
        return self

    def __exit__(self, kind, value, tb):
        seconds = time.perf_counter() - self.start
        boundary()  # a recording span opened inside this phase ends with it
        if self.span is not None:
            self.span.__exit__(kind, value, tb)
        phase = self.phase
        phase.last_seconds = seconds
        if phase.record is not None and kind is None:
            phase.record(seconds)
        return False


SYNC = Phase("xshard.sync", ends_recording=True)
BUILD_GRAPH = Phase("xshard.build_graph")
COMPILE = Phase("xshard.compile", metrics.record_compile)
EXECUTE = Phase("xshard.execute", metrics.record_execute)
TO_DEVICE = Phase("xshard.transfer_to_device", metrics.record_transfer_to_device)
FROM_DEVICE = Phase("xshard.transfer_from_device", metrics.record_transfer_from_device)


def phase(kind: Phase) -> _InPhase:
    """Context manager: the enclosed work is one ``kind`` (a span when tracing, and its metric).

    Example:
        >>> with trace.phase(trace.EXECUTE):  # doctest: +SKIP
        ...     results = compiled(*inputs)
    """
    return _InPhase(kind)


def phased(kind: Phase):
    """Decorator: every call of the function is one ``kind`` (see ``phase``)."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with _InPhase(kind):
                return fn(*args, **kwargs)
        return inner
    return wrap


# -- naming executables ----------------------------------------------------------------------------

# [Note: executable names]
# jax names a jitted callable's program after its ``__name__`` (``jit(<unnamed function>)`` without
# one): the name appears in traces (``PjitFunction(jit(name))``), in the HLO module
# (``jit_name``) and in XLA's dumps. xshard names each program it lowers
# ``xshard_<what>_<n>``: <what> is the innermost ``naming(...)`` in force (e.g. the function a
# compiled step was made from), else the function of the user's frame that triggered the sync (the
# first frame outside xshard and torch; the script's file name for top-level code); <n> counts the
# programs lowered in this process. The name is given after the executable cache is consulted and
# is no part of its key: a graph reached from another function reuses its executable, name and all.

_PROGRAMS = itertools.count(1)
_NAMES: list[str] = []
_last_name = "xshard_graph_0"
_XSHARD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_LIBRARY_DIRS = (_XSHARD_DIR, _TORCH_DIR, "<frozen ")


class naming:
    """Context manager: programs lowered inside are named after ``name``.

    Args:
        name: what the programs compute, e.g. a step function's ``__name__``; characters that are
            not letters, digits or ``_`` become ``_``.

    Example:
        >>> with trace.naming("train_step"):  # doctest: +SKIP
        ...     xshard.sync()                   # compiles jit(xshard_train_step_<n>)
    """

    def __init__(self, name: str):
        if not isinstance(name, str) or not name.strip():
            raise TypeError(f"naming() takes a non-empty str, e.g. 'train_step'; got {name!r}.")
        self.name = _identifier(name)

    def __enter__(self):
        _NAMES.append(self.name)
        return self

    def __exit__(self, *exc):
        _NAMES.pop()
        return False


def user_frame():
    """The innermost frame outside xshard and torch (the user's code), or None."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame = frame.f_back
    return frame


def _identifier(name: str) -> str:
    return re.sub(r"\W+", "_", name).strip("_") or "graph"


def _frame_label(frame) -> str:
    if frame is None:
        return "graph"
    name = frame.f_code.co_name
    if name == "<module>":
        name = os.path.splitext(os.path.basename(frame.f_code.co_filename))[0]
    return _identifier(name)


def program_name() -> str:
    """A fresh name for a program being lowered (see [Note: executable names])."""
    global _last_name
    what = _NAMES[-1] if _NAMES else _frame_label(user_frame())
    _last_name = f"xshard_{what}_{next(_PROGRAMS)}"
    return _last_name


# -- the executable cache's events, and XSHARD_DEBUG -----------------------------------------------

_EXECUTABLE_NAMES = weakref.WeakKeyDictionary()  # jax Compiled -> the name its program was given
_runs = itertools.count(1)


# Callables told the key of every graph about to run (xshard.compat's torch_xla.compile counts
# the different graphs a function runs).
GRAPH_WATCHERS: list = []


def cache_hit(graph, exe) -> None:
    """``exe`` (a cache entry) serves ``graph``: counted, and reported under XSHARD_DEBUG."""
    metrics.record_cache_hit()
    for watch in GRAPH_WATCHERS:
        watch(graph.key)
    if DEBUG:
        _report(graph, _EXECUTABLE_NAMES.get(exe.compiled, "?"), None)


def compiled(graph, exe, cause) -> None:
    """``exe`` was just compiled for ``graph``; ``cause`` says what differs from the nearest cached
    graph (None: nothing was cached)."""
    _EXECUTABLE_NAMES[exe.compiled] = _last_name
    for watch in GRAPH_WATCHERS:
        watch(graph.key)
    if DEBUG:
        _report(graph, _last_name, cause or "no graph was cached yet")


def _report(graph, name: str, cause) -> None:
    frame = user_frame()
    if frame is None:
        where = "outside user code"
    else:
        code = frame.f_code
        line = linecache.getline(code.co_filename, frame.f_lineno).strip()
        where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        if line:
            where += f": {line}"
    ops = len(graph.order) - len(graph.inputs)
    run = next(_runs)
    if cause is None:
        text = f"graph {run}: cached {name} ({ops} ops), for {where}"
    else:
        text = (f"graph {run}: COMPILED {name} ({ops} ops, {len(graph.inputs)} inputs) in "
                f"{COMPILE.last_seconds:.3f} s, for {where}; cause: {cause}")
    print(f"xshard-debug: {text}", file=sys.stderr, flush=True)
