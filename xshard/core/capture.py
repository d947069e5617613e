"""Capturing a whole step: while a capture is open, no value is read and nothing runs.

``xshard.compile`` records a training step once on the lazy tracer, under a capture, and compiles
what it recorded into one program that later calls run without any Python. Inside the capture a
tensor's value does not exist yet, so anything that would need one (``.item()``, ``print(t)``,
``.cpu()``, ``if loss > 0:``, an op that would run on the CPU) is handed to the capture's owner,
which refuses it with an error naming the op and the user's line; ``sync()`` does nothing there
(the whole step is one graph).

Core calls ``check_read``, ``check_fallback`` and ``skips_sync`` where those things happen
(xshard.core.execute, xshard.core.fallback, xshard.core.api); they cost one list test when no
capture is open. This module imports nothing: it sits below every module that calls it.
"""

from __future__ import annotations

import contextlib

_OPEN: list = []


def is_open() -> bool:
    """Whether a capture is open."""
    return bool(_OPEN)


def check_read(what: str, tensor=None) -> bool:
    """Called where core would compute and read a value (``what`` says which read; ``tensor``,
    the tensor read, where there is one). True when the owner lets this tensor's value be read
    (computed now, outside the step's graph)."""
    if _OPEN:
        return bool(_OPEN[-1].on_read(what, tensor))
    return False


def check_fallback(op) -> None:
    """Called before ``op`` would run eagerly on the CPU (it has no lowering rule)."""
    if _OPEN:
        _OPEN[-1].on_fallback(op)


def skips_sync() -> bool:
    """Whether ``sync()`` must do nothing now (a capture is open; its owner is told)."""
    if _OPEN:
        _OPEN[-1].on_sync()
        return True
    return False


@contextlib.contextmanager
def set_aside(kind: str):
    """Inside, the open capture is set aside (reads and syncs run) if its owner lets ``kind``
    run (``owner.lets_run(kind)``); else nothing changes and the owner decides as usual.
    ``kind``: ``"replica collective"`` (xshard.compat's collectives between ``xmp.spawn``
    replicas, each a program of its own)."""
    owner = _OPEN[-1] if _OPEN else None
    if owner is None or not getattr(owner, "lets_run", lambda kind: False)(kind):
        yield
        return
    _OPEN.pop()
    try:
        yield
    finally:
        _OPEN.append(owner)


_ON_CLOSE: list = []


def on_close(fn) -> None:
    """Calls ``fn()`` when the open capture closes (once per registration)."""
    if fn not in _ON_CLOSE:
        _ON_CLOSE.append(fn)


@contextlib.contextmanager
def capturing(owner):
    """Opens a capture whose refusals ``owner`` decides.

    ``owner`` has ``on_read(what, tensor)`` (raise to refuse, return True to let the value be
    computed now), ``on_fallback(op)`` (raise to refuse) and ``on_sync()``.
    """
    _OPEN.append(owner)
    try:
        yield owner
    finally:
        _OPEN.remove(owner)
        while _ON_CLOSE:
            _ON_CLOSE.pop()()
