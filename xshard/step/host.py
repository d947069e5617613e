"""The CPU tensors a step reads while it is recorded.

[Note: host tensors a step reads]
A CPU tensor the step reads (a loss weight in its closure, a module's plain tensor attribute,
Adam's ``betas`` given as tensors: ``scale.to(device)``, ``1 - beta1``) reaches the program as a
constant: the recording reads its value once, and a replay runs none of the step's Python. So
while a step is recorded a ``TorchFunctionMode`` notes every CPU tensor any torch function
receives, with its version counter (shared by a tensor and its views: a view's base is noted).
When the step returns, those still alive are the ones that outlive it:

- written while the step ran (``count += 1`` on a CPU tensor): a replay would not write it, so the
  recording is refused, naming the line;
- otherwise the guard compares each one's version on every call, and a write since (``fill_``,
  ``copy_``, ``+=``) or its death (an attribute or name bound to a new tensor) records the step
  again, with a log line saying which tensor.

Tensors created and dropped inside the step (``torch.arange(n)``, ``1 - beta1`` itself) are
constants of its code and need no guard.
"""

from __future__ import annotations

import random
import weakref

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from xshard.core import api
from xshard.step.errors import CaptureError, user_line


class HostReads(TorchFunctionMode):
    """Notes the CPU tensors torch functions receive, and where one of them is written."""

    def __init__(self):
        super().__init__()
        self.seen: dict = {}  # id(base) -> (weak reference, version when first seen, shape)
        self.written: dict = {}  # id(base) -> the user's line that wrote it first

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bases = []
        for x in _tensors(args, kwargs):
            base = x if x._base is None else x._base
            key = id(base)
            stamp = _stamp(base)
            noted = self.seen.get(key)
            if noted is None or noted[0]() is not base:  # new, or a dead tensor's id reused
                self.seen[key] = (weakref.ref(base), stamp, tuple(base.shape))
                self.written.pop(key, None)
            bases.append((key, base, stamp))
        out = func(*args, **kwargs)
        for key, base, stamp in bases:
            if not _same(base, stamp) and key not in self.written:
                self.written[key] = user_line()
        return out

    def guarded(self, name: str) -> list:
        """``(weak reference, version, shape)`` of each noted tensor that outlives the step;
        raises if the step wrote one."""
        out = []
        for key, (ref, stamp, shape) in self.seen.items():
            base = ref()
            if base is None:
                continue
            if not _same(base, stamp):
                raise CaptureError(
                    f"xshard.compile({name}): the step writes a CPU tensor of shape {list(shape)} "
                    f"that outlives it (at {self.written.get(key, 'an unknown line')}). A replay "
                    f"runs none of the step's Python, so only the recording would write it. Keep "
                    f"it on the device (a buffer, or .to(xshard.device())), or update it outside "
                    f"the step.")
            out.append((ref, stamp, shape))
        return out


def _tensors(args, kwargs):
    """The CPU tensors among ``args`` and ``kwargs`` (one level of lists and tuples deep)."""
    for group in (args, kwargs.values()):
        for x in group:
            if type(x) in (list, tuple):
                yield from (v for v in x if _is_host(v))
            elif _is_host(x):
                yield x


def _is_host(x) -> bool:
    return isinstance(x, torch.Tensor) and not api.is_device_tensor(x) and \
        x.device.type == "cpu"


def _stamp(t: torch.Tensor):
    """What tells a later write to ``t``: its version counter, or for an inference tensor (which
    has none) a copy of its value."""
    return t.clone() if t.is_inference() else t._version


def _same(t: torch.Tensor, stamp) -> bool:
    if type(stamp) is int:
        return t._version == stamp
    return t.shape == stamp.shape and torch.equal(t, stamp)


def changed(tensors) -> str | None:
    """What changed among the guarded ``tensors`` (see ``HostReads.guarded``), or None."""
    for ref, stamp, shape in tensors:
        base = ref()
        if base is None:
            return (f"a CPU tensor of shape {list(shape)} the step reads was freed (replaced by "
                    f"another?)")
        if not _same(base, stamp):
            return f"a CPU tensor of shape {list(shape)} the step reads was written"
    return None


# [Note: Python and NumPy random numbers in a step]
# A step that draws from Python's or NumPy's generators (``random.random() < p`` to drop a layer,
# ``np.random.randint`` for a crop) draws once, when it is recorded: the numbers become constants
# of the program, and every replay repeats the first call's choice where eager draws anew. So the
# recording compares the states of the generators the step can reach (the global ones of
# ``random`` and ``numpy.random``, and each ``random.Random``, ``np.random.Generator``,
# ``RandomState`` or CPU ``torch.Generator`` among the objects it reaches, as seeded augmentation
# keeps one) before and after, and refuses a step that moved one, putting the generator back
# (torch's global CPU generator is checked by the recorder itself). Device draws
# (``torch.rand(..., device=x.device)``) are the replacement: a compiled step draws them anew on
# every call.

_GENERATORS = (random.Random, np.random.Generator, np.random.RandomState, torch.Generator)


def _watched(obj) -> bool:
    if isinstance(obj, torch.Generator):
        return obj.device.type == "cpu" and obj is not torch.default_generator
    return isinstance(obj, _GENERATORS)


def _generator_state(g):
    if isinstance(g, random.Random):
        return g.getstate()
    if isinstance(g, np.random.Generator):
        return g.bit_generator.state
    if isinstance(g, torch.Generator):
        return g.get_state()
    return g.get_state(legacy=False)


def _set_generator_state(g, state) -> None:
    if isinstance(g, random.Random):
        g.setstate(state)
    elif isinstance(g, np.random.Generator):
        g.bit_generator.state = state
    else:
        g.set_state(state)


def _same_state(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


class Generators:
    """The Python and NumPy random generators a step can draw from, and their states before it
    (see [Note: Python and NumPy random numbers in a step])."""

    def __init__(self, reached):
        """``reached``: ``(name, object)`` pairs of what the step reaches; the generators among
        them are watched with the global ones."""
        watched = [("Python's random module (random.random(), random.choice(...))",
                    random.random.__self__),
                   ("NumPy's global generator (np.random.rand(...), np.random.randint(...))",
                    np.random.rand.__self__)]
        seen = {id(g) for _, g in watched}
        for name, obj in reached:
            if _watched(obj) and id(obj) not in seen:
                seen.add(id(obj))
                watched.append((f"the generator {name}", obj))
        self.states = [(name, g, _generator_state(g)) for name, g in watched]

    def moved(self) -> list[str]:
        """The generators the step drew from (each put back as it was), by name."""
        moved = []
        for name, g, state in self.states:
            if not _same_state(_generator_state(g), state):
                _set_generator_state(g, state)
                moved.append(name)
        return moved
