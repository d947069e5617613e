"""What a compiled step refuses, and where in the user's code it happened."""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback

import torch


class CompileError(RuntimeError):
    """``xshard.compile`` cannot record or replay this step; the message says why and what to do."""


class CaptureError(CompileError):
    """The step needs a value, or a CPU op, while it is being recorded (values exist only once the
    whole step has run)."""


class StateError(CompileError):
    """The step keeps state that a replay without Python cannot update."""


# Frames inside these directories are library code; the user's line is the innermost frame outside.
# The standard library's too: a contextlib frame is never the user's line.
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,)) + (
    os.path.join(sysconfig.get_paths()["stdlib"], ""),)
_XSHARD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_ROOTS = tuple(os.path.dirname(d.rstrip(os.sep)) + os.sep for d in _LIBRARY_DIRS)


def _is_library(filename: str) -> bool:
    filename = os.path.abspath(filename)
    if filename.startswith(_LIBRARY_DIRS):
        return True
    if filename.startswith(_XSHARD_DIR):
        # xshard's own reference models are user code for this purpose.
        return _is_xshard(filename)
    return "/site-packages/" in filename or filename.startswith("<frozen")


def user_line() -> str:
    """``file:line: code`` of the innermost frame of the current stack outside torch and xshard,
    and, when a library called from there did it (``float(self.num_batches_tracked)`` in
    BatchNorm's forward), that library's innermost line too."""
    inner = None  # the innermost frame outside xshard itself
    for frame in reversed(traceback.extract_stack()):
        if not _is_library(frame.filename):
            where = _line(frame, frame.filename)
            if inner is not None and inner is not frame:
                where += f" (inside {_line(inner, _library_path(inner.filename))}, in {inner.name})"
            return where
        if inner is None and not _is_xshard(frame.filename):
            inner = frame
    return "<unknown line>"


def _line(frame, path: str) -> str:
    code = f": {frame.line.strip()}" if frame.line else ""
    return f"{path}:{frame.lineno}{code}"


def _library_path(filename: str) -> str:
    """``torch/nn/modules/batchnorm.py`` rather than the full path into site-packages."""
    filename = os.path.abspath(filename)
    for root in _LIBRARY_ROOTS:
        if filename.startswith(root):
            return filename[len(root):]
    return filename


def _is_xshard(filename: str) -> bool:
    filename = os.path.abspath(filename)
    return filename.startswith(_XSHARD_DIR) and not filename.startswith(
        os.path.join(_XSHARD_DIR, "models") + os.sep)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by the caller point at the user's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2
