"""Profiling: traces of a program's host and device time, in PyTorch/XLA's names (``xp``).

A trace shows, on one timeline, the user's own spans (``Trace``, ``StepTrace``), xshard's work
(``xshard.record``: recording ops; ``xshard.sync`` with ``xshard.build_graph``, ``xshard.compile``
and ``xshard.execute``; ``xshard.transfer_to_device`` / ``xshard.transfer_from_device``), each
program xshard runs, named ``jit(xshard_<function>_<n>)`` after the user function that triggered
it, and XLA's own events (on CPU, each fused HLO op). See [Note: spans of xshard's phases] in
``xshard.core.trace``.

Two ways to take one, both built on ``jax.profiler``:

- in the program: ``start_trace(logdir)`` ... ``stop_trace()``;
- from outside: the program calls ``start_server(port)``; ``trace(addr, logdir, duration_ms)``
  (another process, or TensorBoard's / xprof's "capture profile") collects for a while. The
  collecting side needs the ``xprof`` package: ``pip install 'xshard[profile]'``.

Either writes ``<logdir>/plugins/profile/<run>/<host>.xplane.pb`` and ``<host>.trace.json.gz``.
To view them, offline: ``xprof --logdir <logdir> --port 8791`` (xprof's UI is in the package; or
TensorBoard's profile tab with ``tensorboard-plugin-profile``); the ``.trace.json.gz`` opens in
Perfetto (ui.perfetto.dev or a local ``trace_processor``) and chrome://tracing;
``jax.profiler.ProfileData.from_file(xplane)`` reads the events from Python.

Example:
    >>> import xshard.profiler as xp
    >>> xp.start_trace("/tmp/profile")
    >>> for step, (x, y) in enumerate(loader):          # doctest: +SKIP
    ...     with xp.StepTrace("train_step", step_num=step):
    ...         with xp.Trace("forward"):
    ...             loss = model(x, y)
    ...         loss.backward(); opt.step(); opt.zero_grad()
    >>> run_dir = xp.stop_trace()                       # doctest: +SKIP
"""

from __future__ import annotations

import functools
import os
import threading
import time

import xshard
from xshard.core import runtime
from xshard.core import trace as _trace

jax = runtime.jax_module()

__all__ = ["start_server", "stop_server", "trace", "trace_detached", "start_trace", "stop_trace",
           "Trace", "StepTrace", "trace_me", "set_tracer_marked_step", "get_tracer_marked_step"]


# -- a profiler server and remote capture ----------------------------------------------------------

_server = None


def start_server(port: int, only_on_master: bool = True):
    """Starts a profiler server in this process, for ``trace()`` or TensorBoard/xprof to collect.

    The server is jax's (``jax.profiler.start_server``); it listens on every network interface of
    the machine, so use a port your firewall keeps private.

    Args:
        port: the TCP port to listen on (1-65535).
        only_on_master: in a multi-process run, start it on process 0 only.

    Returns:
        The server object (``stop_server()`` stops it), or None on a process that starts none.

    Example:
        >>> server = xshard.profiler.start_server(9012)  # doctest: +SKIP
    """
    global _server
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an int in 1..65535, e.g. 9012; got {port!r}.")
    if only_on_master and runtime.process_index() != 0:
        return None
    if _server is not None:
        raise RuntimeError("A profiler server is already running in this process (one at most); "
                           "call xshard.profiler.stop_server() first.")
    _server = jax.profiler.start_server(port)
    return _server


def stop_server() -> None:
    """Stops the profiler server ``start_server`` started."""
    global _server
    if _server is None:
        raise RuntimeError("No profiler server is running: start_server(port) starts one.")
    jax.profiler.stop_server()
    _server = None


def _xprof_capture():
    try:
        from xprof.convert import _pywrap_profiler_plugin
    except ImportError as e:
        raise ImportError(
            "xshard.profiler.trace() collects from a profiler server through the xprof package, "
            "which is not installed: pip install 'xshard[profile]' (or pip install xprof). To "
            "profile the current process, start_trace()/stop_trace() need nothing more.") from e
    return _pywrap_profiler_plugin.trace


def trace(service_addr: str, logdir: str, duration_ms: int = 1000, num_tracing_attempts: int = 3,
          host_tracer_level: int = 2, device_tracer_level: int = 1, delay_ms: int = 0,
          timeout_s: int = 120, interval_s: int = 5):
    """Collects a trace from profiler servers (``start_server``) for ``duration_ms``; blocks.

    Needs the ``xprof`` package (``pip install 'xshard[profile]'``).

    Args:
        service_addr: ``host:port`` of the server, or several, comma-separated
            (e.g. ``"127.0.0.1:9012"``).
        logdir: the directory to write ``plugins/profile/<run>/`` into.
        duration_ms: how long to collect.
        num_tracing_attempts: attempts per request when the server answers with an error.
        host_tracer_level: host events: 1 critical only, 2 info, 3 verbose.
        device_tracer_level: device events: 1 on, 0 off.
        delay_ms: start collecting this long after the request arrives.
        timeout_s: keep retrying a server that cannot be reached for this long.
        interval_s: wait this long between such retries.

    Returns:
        The run directory written (``<logdir>/plugins/profile/<run>``), or None if none appeared.

    Example:
        >>> xshard.profiler.trace("127.0.0.1:9012", "/tmp/prof", duration_ms=2000)  # doctest: +SKIP
    """
    if not isinstance(service_addr, str) or not service_addr.strip():
        raise ValueError(f"service_addr must be 'host:port' (several comma-separated), e.g. "
                         f"'127.0.0.1:9012'; got {service_addr!r}.")
    for name, value, least in (("duration_ms", duration_ms, 1),
                               ("num_tracing_attempts", num_tracing_attempts, 1),
                               ("delay_ms", delay_ms, 0), ("timeout_s", timeout_s, 0),
                               ("interval_s", interval_s, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}; got {value!r}.")
    capture = _xprof_capture()
    addresses = ",".join(a.strip().removeprefix("grpc://") for a in service_addr.split(","))
    options = {"host_tracer_level": host_tracer_level, "device_tracer_level": device_tracer_level,
               "delay_ms": delay_ms}
    logdir = os.fspath(logdir)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            capture(addresses, logdir, "", True, duration_ms, num_tracing_attempts, options)
            break
        except Exception as e:  # noqa: BLE001  (the binding raises its own error types)
            if time.monotonic() + interval_s > deadline:
                raise RuntimeError(
                    f"Could not collect a trace from {addresses} within timeout_s={timeout_s}: "
                    f"{e}. Is a profiler server running there (xshard.profiler.start_server)?"
                ) from e
            time.sleep(interval_s)
    return _latest_run(logdir)


def trace_detached(*args, **kwargs) -> threading.Thread:
    """``trace(...)`` in a background thread (same arguments); returns the started thread."""
    thread = threading.Thread(target=trace, args=args, kwargs=kwargs, daemon=True)
    thread.start()
    return thread


# -- tracing this process --------------------------------------------------------------------------

_logdir = None


def start_trace(log_dir: str, *, create_perfetto_trace: bool = False, python_tracer: bool = False,
                host_tracer_level: int = 2) -> None:
    """Starts collecting a trace of this process (until ``stop_trace()``).

    Args:
        log_dir: the directory to write ``plugins/profile/<run>/`` into.
        create_perfetto_trace: also write ``perfetto_trace.json.gz`` (the trace JSON without its
            metadata, as Perfetto wants it).
        python_tracer: also record every Python function call (detailed, but slows the program
            down several times).
        host_tracer_level: host events: 1 critical only, 2 info (includes xshard's), 3 verbose.

    Example:
        >>> xshard.profiler.start_trace("/tmp/profile")  # doctest: +SKIP
    """
    global _logdir
    if host_tracer_level not in (1, 2, 3):
        raise ValueError(f"host_tracer_level must be 1, 2 or 3; got {host_tracer_level!r}.")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if python_tracer else 0
    options.host_tracer_level = host_tracer_level
    log_dir = os.fspath(log_dir)
    # Checked now: JAX writes the trace at stop_trace, and a failed write there leaves its profiler
    # unable to start again in this process.
    try:
        os.makedirs(log_dir, exist_ok=True)
        writable = os.access(log_dir, os.W_OK | os.X_OK)
    except OSError as e:
        writable, why = False, e.strerror
    else:
        why = "permission denied"
    if not writable:
        raise ValueError(f"start_trace: cannot write a trace into log_dir {log_dir!r} "
                         f"({why}); pass a directory this process can write (a missing one is "
                         f"created).")
    try:
        jax.profiler.start_trace(log_dir, create_perfetto_trace=create_perfetto_trace,
                                 profiler_options=options)
    except RuntimeError as e:
        stop = ("xshard.profiler.stop_trace()" if _logdir is not None else
                "jax.profiler.stop_trace() (it was started with jax.profiler.start_trace)")
        raise RuntimeError(f"{e} Call {stop} before starting another.") from e
    _logdir = log_dir
    _trace.boundary()  # the next recorded op opens a recording span


def stop_trace() -> str:
    """Stops the trace ``start_trace`` started and writes it.

    Returns:
        The run directory holding it: ``<log_dir>/plugins/profile/<run>``, with
        ``<host>.xplane.pb`` (xprof, TensorBoard, ``jax.profiler.ProfileData``) and
        ``<host>.trace.json.gz`` (Perfetto, chrome://tracing).
    """
    global _logdir
    if _logdir is None:
        raise RuntimeError("No trace is running: xshard.profiler.start_trace(log_dir) starts one.")
    _trace.boundary()
    logdir, _logdir = _logdir, None
    _wait_for_free_run_name(logdir)
    jax.profiler.stop_trace()
    return _latest_run(logdir)


def _wait_for_free_run_name(logdir: str) -> None:
    """Waits (under a second) until no run directory of ``logdir`` is named after the current
    second: JAX names a trace's run directory by the time to the second, so a second trace written
    within the same second would overwrite the first."""
    root = os.path.join(logdir, "plugins", "profile")
    while True:
        now = time.time()
        names = {time.strftime("%Y_%m_%d_%H_%M_%S", clock(now))
                 for clock in (time.localtime, time.gmtime)}
        if not any(os.path.exists(os.path.join(root, name)) for name in names):
            return
        time.sleep(1.0 - now % 1.0 + 0.01)


def _latest_run(logdir: str):
    root = os.path.join(logdir, "plugins", "profile")
    if not os.path.isdir(root):
        return None
    runs = [os.path.join(root, d) for d in os.listdir(root)]
    runs = [r for r in runs if os.path.isdir(r)]
    return max(runs, key=os.path.getmtime) if runs else None


# -- user spans ------------------------------------------------------------------------------------

_TRACER_MARKED_STEP = False


def set_tracer_marked_step(value: bool) -> None:
    """Records whether a ``StepTrace`` marks the current step (so a loader need not sync again)."""
    global _TRACER_MARKED_STEP
    _TRACER_MARKED_STEP = bool(value)


def get_tracer_marked_step() -> bool:
    """Whether a ``StepTrace`` marked the current step."""
    return _TRACER_MARKED_STEP


def _check_name(name) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"A trace span's name is a non-empty str, e.g. 'forward'; got {name!r}.")


class Trace:
    """Context manager: the enclosed code is one named span on the trace timeline.

    Costs about 1 µs when no trace is being collected. Values passed as keyword arguments are
    shown with the span.

    Args:
        name: the span's name.
        **kwargs: values to show with it (e.g. ``batch=32``).

    Example:
        >>> with xshard.profiler.Trace("forward"):  # doctest: +SKIP
        ...     loss = model(x, y)
    """

    _annotation = jax.profiler.TraceAnnotation

    def __init__(self, name: str, **kwargs):
        _check_name(name)
        self.name = name
        self.kwargs = kwargs
        self._spans = []

    def __enter__(self):
        _trace.boundary()
        span = self._annotation(self.name, **self.kwargs)
        span.__enter__()
        self._spans.append(span)
        return self

    def __exit__(self, kind, value, tb):
        _trace.boundary()
        self._spans.pop().__exit__(kind, value, tb)
        return False


class StepTrace(Trace):
    """Context manager: one training step, a span that xprof's step-time analysis counts.

    On exit, the step's pending work is run: ``xshard.sync()`` (as PyTorch/XLA's StepTrace does),
    unless the block raised.

    Args:
        name: the step span's name, e.g. ``'train_step'``.
        step_num: the step's number (shown with the span; xprof orders steps by it).
        **kwargs: other values to show with the span.

    Example:
        >>> for step, (x, y) in enumerate(loader):  # doctest: +SKIP
        ...     with xshard.profiler.StepTrace("train_step", step_num=step):
        ...         train_step(x, y)
    """

    _annotation = jax.profiler.StepTraceAnnotation

    def __init__(self, name: str, step_num: int | None = None, **kwargs):
        if step_num is not None:
            if isinstance(step_num, bool) or not isinstance(step_num, int):
                raise TypeError(f"step_num must be an int (the step's number); got {step_num!r}.")
            kwargs["step_num"] = step_num
        super().__init__(name, **kwargs)

    def __enter__(self):
        set_tracer_marked_step(True)
        return super().__enter__()

    def __exit__(self, kind, value, tb):
        try:
            if kind is None:
                xshard.sync()
        finally:
            super().__exit__(kind, value, tb)
        return False


def trace_me(name: str):
    """Decorator: every call of the function is a ``Trace(name)`` span.

    Example:
        >>> @xshard.profiler.trace_me("loss")  # doctest: +SKIP
        ... def compute_loss(logits, y): ...
    """
    _check_name(name)

    def decorate(fn):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            with Trace(name):
                return fn(*args, **kwargs)
        return traced
    return decorate
