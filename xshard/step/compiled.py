"""``xshard.compile``: the object a compiled step is, and how a call finds its program.

A call flattens its arguments (``Arguments``): device tensors are inputs (compared by shape, dtype,
sharding and ``requires_grad``), host tensors are moved to the device first, Python ``int`` and
``float`` become inputs too (0-d device tensors inside the step), modules and optimizers are state
roots, anything else is static (compared by value, and an object's settings with it: see
``_settings_of``). Programs are filed under that key; the last one used is tried first, then the
others recorded for the key. When none fits, the step is recorded again (see record.py), and a
log line (logger ``xshard``, INFO) says what changed.
"""

from __future__ import annotations

import collections
import logging
import warnings

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from xshard.core import api, capture
from xshard.core.device import device
from xshard.step import state as st
from xshard.step.errors import CompileError, user_stacklevel
from xshard.step.program import Exact, Program, difference, spec_of
from xshard.step.record import Recording

log = logging.getLogger("xshard")

_TENSOR, _NUMBER, _STATIC, _ROOT = "tensor", "number", "static", "root"
_MANY_RECORDINGS = 8  # recordings of one step after which a warning says what keeps changing


def _aliases(tensors) -> tuple:
    """Which tensors share a storage (one tensor passed twice, ``x`` and ``x.detach()``): per
    tensor, the position of the first with its storage; () when none does. A write through one
    is seen through the other, so a program recorded for one pattern is wrong for another."""
    cells = list(map(api.storage, tensors))
    if len(set(map(id, cells))) == len(cells):
        return ()
    first = {}
    return tuple(first.setdefault(id(c), k) for k, c in enumerate(cells))


def _settings_of(obj):
    """The Python settings an object passed as an argument holds (``cfg.scale`` of a dataclass or
    a namespace), compared by value on every call: the object itself is compared by its own
    ``==``, which for one changed in place compares it with itself. None for other objects."""
    if not st.has_attributes(obj) or isinstance(obj, (nn.Module, torch.optim.Optimizer)):
        return None
    try:
        items = vars(obj).items()
    except TypeError:  # __slots__ only
        return None
    return Exact(tuple((k, v) for k, v in items if st.is_setting(v)))


class Arguments:
    """One call's arguments, flattened and classified, with the key programs are filed under."""

    __slots__ = ("leaves", "treedef", "kinds", "key", "views", "hosts", "_names")

    def __init__(self, compiled: "CompiledStep", args, kwargs):
        self.views = {}  # leaf index -> the view passed there (the step gets a copy)
        self.hosts = set()  # leaf indices of CPU tensors (the step gets a device copy)
        if not kwargs and not compiled.static_argnums and all(
                api.is_device_tensor(a) and not api.is_view(a) and api.settled(a) for a in args):
            # The common call, step(x, y): device tensors only.
            self.leaves, self.kinds = list(args), [_TENSOR] * len(args)
            self.treedef = _flat_treedef(len(args))
            self.key = (self.treedef, (), (), tuple(spec_of(a) for a in args), _aliases(args))
            self._names = None
            return
        static, static_names = compiled.static_argnums, compiled.static_argnames
        if static or static_names:
            statics = tuple((Exact(args[i]), _settings_of(args[i])) for i in sorted(static)
                            if i < len(args)) + tuple(
                (k, Exact(kwargs[k]), _settings_of(kwargs[k])) for k in sorted(static_names)
                if k in kwargs)
            args = tuple(None if i in static else a for i, a in enumerate(args))
            kwargs = {k: (None if k in static_names else v) for k, v in kwargs.items()}
        else:
            statics = ()
        leaves, self.treedef = pytree.tree_flatten((args, kwargs))
        kinds, parts, pending = [], [], False
        for i, leaf in enumerate(leaves):
            if api.is_device_tensor(leaf):
                if api.is_view(leaf):  # passed by value: the view's data, in its own storage
                    self.views[i] = leaf
                    leaf = leaves[i] = api.new_tensor(api.value(leaf),
                                                      requires_grad=leaf.requires_grad)
                if not api.settled(leaf):
                    pending = True
                kinds.append(_TENSOR)
            elif isinstance(leaf, torch.Tensor):
                self.hosts.add(i)
                moved = leaf.detach().to(compiled.device)
                leaves[i] = moved.requires_grad_() if leaf.requires_grad else moved
                kinds.append(_TENSOR)
            elif type(leaf) in (int, float):
                kinds.append(_NUMBER)
                parts.append((_NUMBER, type(leaf)))
            elif isinstance(leaf, (nn.Module, torch.optim.Optimizer)):
                kinds.append(_ROOT)
                parts.append((_ROOT, id(leaf)))
            else:
                kinds.append(_STATIC)
                parts.append((_STATIC, Exact(leaf), _settings_of(leaf)))
        if pending:
            api.sync()
        tensors = [leaves[i] for i, k in enumerate(kinds) if k is _TENSOR]
        self.leaves, self.kinds = leaves, kinds
        self.key = (self.treedef, statics, tuple(parts), tuple(map(spec_of, tensors)),
                    _aliases(tensors))
        self._names = None

    def roots(self) -> list:
        return [leaf for leaf, kind in zip(self.leaves, self.kinds) if kind is _ROOT]

    def tensor_positions(self) -> list[int]:
        return [i for i, kind in enumerate(self.kinds) if kind is _TENSOR]

    def number_positions(self) -> list[int]:
        return [i for i, kind in enumerate(self.kinds) if kind is _NUMBER]

    def rebuild(self, leaves, call_args, call_kwargs):
        """``(args, kwargs)`` for the function: ``leaves`` put back, static arguments as given."""
        args, kwargs = pytree.tree_unflatten(leaves, self.treedef)
        args = tuple(call_args[i] if a is None and i < len(call_args) and call_args[i] is not None
                     else a for i, a in enumerate(args))
        kwargs = {k: (call_kwargs[k] if v is None else v) for k, v in kwargs.items()}
        return args, kwargs

    def name(self, index: int) -> str:
        """A readable name of leaf ``index``: ``argument 1``, ``argument 0[2]``, ``argument x``."""
        if self._names is None:
            paths, _ = pytree.tree_flatten_with_path(
                pytree.tree_unflatten(list(range(len(self.leaves))), self.treedef))
            self._names = {}
            for path, leaf in paths:
                where, *rest = path[1:]  # path[0]: args or kwargs
                head = getattr(where, "idx", getattr(where, "key", "?"))
                self._names[leaf] = f"argument {head}" + "".join(
                    f"[{getattr(p, 'idx', None) if hasattr(p, 'idx') else repr(p.key)}]"
                    for p in rest)
        return self._names.get(index, f"argument {index}")


_TREEDEFS: dict = {}


def _flat_treedef(n: int):
    """The treedef of ``((a0, ..., an-1), {})`` (cached)."""
    treedef = _TREEDEFS.get(n)
    if treedef is None:
        treedef = _TREEDEFS[n] = pytree.tree_flatten((tuple(range(n)), {}))[1]
    return treedef


class CompiledStep:
    """A step function compiled by ``xshard.compile``; call it as the function itself.

    Attributes:
        traces: how many times the step was recorded (compiled programs made).
        calls: how many times it was called.
        retrace_reasons: for each recording after the first, what had changed.
    """

    def __init__(self, fn, *, state=(), static_argnums=(), static_argnames=(), name=None):
        if not callable(fn):
            raise TypeError(f"xshard.compile needs a callable (the training step), got "
                            f"{type(fn).__name__}.")
        if isinstance(static_argnums, int):
            static_argnums = (static_argnums,)
        if isinstance(static_argnames, str):
            static_argnames = (static_argnames,)
        if not all(type(i) is int and i >= 0 for i in static_argnums):
            raise TypeError(f"static_argnums must be non-negative ints (positions of arguments), "
                            f"got {static_argnums!r}.")
        if not all(isinstance(n, str) for n in static_argnames):
            raise TypeError(f"static_argnames must be keyword-argument names (str), got "
                            f"{static_argnames!r}.")
        self.fn = fn
        self.state = tuple(state) if isinstance(state, (list, tuple)) else (state,)
        self.static_argnums = frozenset(static_argnums)
        self.static_argnames = frozenset(static_argnames)
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.device = device()
        self.warned_sync = False
        self.warned_rate = False
        self.unjoined: set = set()  # slot keys never read as one input (Recording._note_parting)
        self.traces = 0
        self.calls = 0
        self.retrace_reasons: list[str] = []
        self._programs: dict = {}
        self._last: Program | None = None
        self._last_key = None

    def __call__(self, *args, **kwargs):
        if capture.is_open():
            raise CompileError(
                f"xshard.compile({self.name}) called inside another compiled step; call the inner "
                f"function directly (the outer step records it too).")
        self.calls += 1
        call = Arguments(self, args, kwargs)
        reason = None
        last = self._last
        if last is not None and call.key == self._last_key:
            reason = last.check(call)
            if reason is None:
                return last.run(call)
        for program in self._programs.get(call.key, ()):
            if program is not last and program.check(call) is None:
                self._last, self._last_key = program, call.key
                return program.run(call)
        if reason is None and last is not None:
            reason = self._key_difference(call)
        return self._record(call, args, kwargs, reason)

    def _key_difference(self, call: Arguments) -> str:
        old_def, old_static, old_parts, old_tensors, old_aliases = self._last_key
        new_def, new_static, new_parts, new_tensors, new_aliases = call.key
        if old_def != new_def:
            return f"argument structure: {old_def} -> {new_def}"
        if old_static != new_static:
            return f"static arguments: {old_static} -> {new_static}"
        if old_parts != new_parts:
            return f"non-tensor arguments: {old_parts} -> {new_parts}"
        positions = call.tensor_positions()
        for i, a, b in zip(positions, old_tensors, new_tensors):
            if a != b:
                return difference(call.name(i), a, b)
        if old_aliases != new_aliases:
            return (f"arguments sharing a storage (per tensor argument, the first with its "
                    f"storage): {old_aliases or 'none'} -> {new_aliases or 'none'}")
        return "arguments"

    def _record(self, call: Arguments, args, kwargs, reason):
        program, result = Recording(self, call, args, kwargs).run()
        program.measure_after_first_store()
        self.traces += 1
        if self.traces > 1:
            self.retrace_reasons.append(reason or "state")
            log.info("xshard.compile(%s): recording the step again (recording %d): %s",
                     self.name, self.traces, reason or "state changed")
        self._programs.setdefault(call.key, []).append(program)
        self._last, self._last_key = program, call.key
        if self.traces == _MANY_RECORDINGS:
            self._warn_many_recordings()
        return result

    def _warn_many_recordings(self) -> None:
        """Once, at the ``_MANY_RECORDINGS``-th recording: what keeps changing (as torch.compile
        warns when it hits its recompile limit)."""
        counts = collections.Counter(r.split(":")[0] for r in self.retrace_reasons)
        common = "; ".join(f"{what} ({n} times)" for what, n in counts.most_common(3))
        hint = ""
        if any(k in common for k in ("momentum", "betas")):
            hint = (" A scheduler that cycles momentum (OneCycleLR, CyclicLR) changes it on every "
                    "step: pass cycle_momentum=False, or run this loop without xshard.compile.")
        warnings.warn(
            f"xshard.compile({self.name}) has recorded and compiled the step {self.traces} "
            f"times in {self.calls} calls; each recording compiles a new program. What changed "
            f"most: {common}. Anything that shapes the program (an input shape, an optimizer "
            f"hyper-parameter other than the learning rate, a Python setting) records it again; "
            f"keep it fixed, or pass the value as a tensor argument.{hint}",
            stacklevel=user_stacklevel())

    def __repr__(self):
        return f"<xshard.compile({self.name}): {self.traces} recording(s), {self.calls} call(s)>"
