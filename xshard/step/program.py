"""A recorded step as a program: its executable, its guard, where its inputs and outputs live.

``Program.check`` decides whether the program can run for this call (see [Note: the guard]);
``Program.run`` reads the inputs from their places, takes the call's random draws from the stream
(see [Note: random draws in a compiled step] in record.py), calls the executable and stores the
results: the whole per-call work of a compiled step, with nothing recorded and no graph built. The
call goes through what every execution does: the multi-process check (xshard.core.divergence),
the ``xshard.execute`` span and the execution metrics (xshard.core.trace).

[Note: the guard]
A program was recorded for one form of the state: which slots held tensors, with which shapes,
dtypes, shardings and ``requires_grad``; the optimizers' hyper-parameters (all but the learning
rate); each module's ``training`` flag; the grad mode; the default dtype. A replay is right only if
the state still has that form. Checking every tensor's form on every call would cost as much as the
step's own dispatch, so the check is by identity: the program remembers the object it left in each
slot and, for the storages it reads, their write counters after it wrote them. When both are
unchanged (the common case: nothing touched the state between calls) the form is the one the
program produced, which by construction is the one it reads. Anything else is compared in full, and
an equal form is adopted, except in a slot that held a parameter: its gradient and optimizer state
were found through that object. The objects the step reached its state through are compared by
identity (see [Note: what the step reaches] in record.py).

[Note: slots sharing data]
Slots can hold one data node: a tensor tied in two modules, a parameter and its optimizer group,
``ema.copy_(p)`` (the copy shares p's data until one is written), ``step(x, x)``, and AdamW's step
counts, which a compiled step stores as one array (see [Note: values computed twice] in
xshard.core.graph). The program then reads that data once, from the first slot, so each call checks
that the other slots still hold the same node; when one does not (``ema`` and ``p`` each written
since, ``step(x, y)``), the step is recorded again, with an input per slot. Such data is consumed
only when the step overwrites every storage holding it.

[Note: donation of replayed state]
A program consumes (donates) the arrays of the state it overwrites, as a lazy sync does for buffers
no live tensor holds. Between calls those arrays are held by the storages the program wrote them to,
and by nothing else, unless the user made another tensor hold one (``ema.copy_(p)`` shares p's data
node) or left pending work reading one. Both show as references beyond those counted when the
program wrote the array, so such an input is passed as a fresh copy instead. The program itself
holds no data node: it knows each input's storage by its write counter. (It held the node it last
wrote there, so a second compiled step on the same model, an evaluation step, kept a copy of every
parameter alive between its calls, and the training step then copied them instead of consuming.)
"""

from __future__ import annotations

import math
import operator
import sys
from itertools import chain

import numpy as np
import torch
import torch.utils._pytree as pytree

from xshard.core import api, arrays, compiler, divergence, ir, placement, rng, runtime, trace
from xshard.step import host
from xshard.step import optim as optim_support
from xshard.step import packing
from xshard.step import state as st

_DATA = ir.DATA
# A tensor's hooks on its gradient: None until one is registered, then a dict.
_TENSOR_HOOKS = operator.attrgetter("_backward_hooks", "_post_accumulate_grad_hooks")
_HOOK_KINDS = ("gradient hooks", "post-accumulate-grad hooks")


# -- the form of what a slot holds ----------------------------------------------------------------


def spec_of(obj):
    """What the guard compares for the object in a slot: None, a tensor's form, or a value."""
    if obj is None:
        return None
    if api.is_device_tensor(obj):
        node = api.storage_value(api.storage(obj))
        return ("tensor", tuple(obj.shape), obj.dtype, obj.requires_grad, api.is_view(obj),
                tuple(node.shape), node.sharding if node.op is _DATA else "pending",
                api.annotation(obj), obj.grad_fn is not None)
    if isinstance(obj, torch.Tensor):
        return ("host tensor", tuple(obj.shape), obj.dtype, id(obj), obj._version)
    return ("value", Exact(obj))


class Exact:
    """A Python value compared by type and exact value (floats by bits; tensors by identity)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return type(other) is Exact and same_value(self.value, other.value)

    def __hash__(self):
        try:
            return hash((type(self.value), self.value))
        except TypeError:
            return id(self.value)

    def __repr__(self):
        return repr(self.value)


def same_value(a, b) -> bool:
    """``a`` and ``b`` have the same type and value (floats by bits, nan equal to nan)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a is b
    if isinstance(a, float):
        return a.hex() == b.hex() or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001  (a value without a plain ==)
        return a is b


def describe(spec) -> str:
    if spec is None:
        return "None"
    if spec[0] == "tensor":
        _, shape, dtype, grad, view, _, sharding, annotation, history = spec
        text = f"tensor{list(shape)} {str(dtype).replace('torch.', '')}"
        if grad:
            text += " requires_grad"
        if history:
            text += " (with autograd history)"
        if view:
            text += " (a view)"
        if annotation is not None:
            text += f" {getattr(annotation, 'hlo_sharding', annotation)}"
        elif sharding not in (None, "pending"):
            text += f" {sharding}"
        return text
    if spec[0] == "host tensor":
        return f"a host tensor{list(spec[1])}"
    return repr(spec[1])


_LABELS = ("", "shape", "dtype", "requires_grad", "view", "storage shape", "sharding",
           "annotation", "autograd history")


def difference(name: str, old, new) -> str:
    """A log line: how ``name`` changed from form ``old`` to ``new``."""
    if old is not None and new is not None and old[0] == new[0] == "tensor":
        what = next((_LABELS[i] for i in range(1, len(old)) if old[i] != new[i]), "form")
        return f"{name}: {what} {describe(old)} -> {describe(new)}"
    return f"{name}: {describe(old)} -> {describe(new)}"


# -- inputs ---------------------------------------------------------------------------------------


class Rate:
    """A group's learning rate as the program's input: placed on the devices once per value."""

    __slots__ = ("optimizer", "group", "dtype", "sharding", "value", "version", "placed")

    def __init__(self, optimizer, group, dtype, sharding):
        # The groups are read through the optimizer on each call: load_state_dict (and a user)
        # may give it a new list of them.
        self.optimizer, self.group = optimizer, group
        self.dtype, self.sharding = dtype, sharding
        self.value = self.version = self.placed = None

    def array(self):
        lr = self.optimizer.param_groups[self.group]["lr"]
        # A tensor rate may be changed in place (``lr.fill_(0.05)``): its version says so.
        if lr is not self.value or (self.version is not None and lr._version != self.version):
            self.placed = arrays.put(np.asarray(optim_support.host_rate(lr), self.dtype),
                                     self.sharding, "a learning rate")
            self.value = lr
            self.version = lr._version if isinstance(lr, torch.Tensor) else None
        return self.placed

    def host(self) -> float:
        return optim_support.host_rate(self.optimizer.param_groups[self.group]["lr"])


def _copy(array):
    return runtime.jax_module().numpy.array(array, copy=True)


# -- the program ----------------------------------------------------------------------------------


class Write:
    """Output ``position`` stored into the tensor of slot ``slot``."""

    __slots__ = ("slot", "position", "shape", "dtype", "annotation", "maker", "sharding")

    def __init__(self, slot, position, shape, dtype, annotation):
        self.slot, self.position = slot, position
        self.shape, self.dtype, self.annotation = tuple(shape), dtype, annotation
        self.maker = self.sharding = None

    def node(self, array):
        sharding = array.sharding
        if sharding is not self.sharding:
            self.sharding = sharding
            self.maker = api.data_node_maker(self.shape, self.dtype, sharding)
        return self.maker(array)


class Program:
    """A recorded step: its executable, its guard, and where its inputs and outputs live."""

    def __init__(self, name: str):
        self.name = name
        self.slots: list[st.Slot] = []
        self.arg_slots: list[st.ArgSlot] = []
        self.specs: list = []  # per slot, the form the program was recorded for
        self.guarded: list[int] = []  # the slots the guard compares (arguments have the key)
        # Per slot: the object the last call left there, its storage when it is a base tensor
        # the program can write into (else None), and the data node read from it (inputs only).
        self.expect: list = []
        self.storage: list = []
        self.source: list = []  # per slot, the storage of the tensor there (view or base)
        # Per input slot, the version of its storage when the program last saw it (None for the
        # other slots): the program keeps no data node alive (see [Note: donation of replayed
        # state]).
        self.expect_version: list = []
        self.inputs: list = []  # per executable input: (kind, a, b)
        self.writes: list[Write] = []
        # Per output, after the first call: (position, node maker, (slot, Write) per slot).
        self.write_plan = None
        self.clears: list[int] = []  # slots the step leaves empty
        self.arg_writes: frozenset = frozenset()  # argument slots the step writes
        self.returns = None  # (treedef, per leaf (kind, a, b))
        self.compiled = None  # the jax executable (``executable.compiled``)
        self.executable = None  # xshard.core.compiler.Executable
        self.graph = None  # kept for the multi-process check only (see record.py)
        # (slot, other slots) per input that several slots held (see [Note: slots sharing data])
        self.shared: list = []
        self.donated: list = []  # (input position, slot) of each consumed input
        self.copied: list[int] = []  # inputs the executable consumes that must be kept
        self.draws = 0  # random draws per call
        self.handles: tuple = ()  # outputs that bound the calls in flight (compiler.dispatched)
        self.constant_values: list = []  # per input: the constant, or None (see prepare)
        self.state_inputs: list = []
        self.other_inputs: list = []
        self.random_inputs: list = []  # (input position, counter offset or None for the seed)
        self.fixed_numbers: dict = {}
        self.seed = self.seed_array = None
        self.position = None  # the random stream's (seed, counter) for the running call
        self.base_refs: dict = {}  # slot -> refs() of the node stored last
        self.placement: list[int] = []  # outputs whose arrays must be placed (see api.placed)
        # (input position, slot, whether an argument slot, sharding) of each input the
        # executable's placement plan moves (see xshard.core.placement): data on other devices.
        self.moves: list = []
        # Per argument slot, the state slot whose storage the argument was (``m.weight.detach()``
        # passed in), else None; and id(storage) -> state slot, made again after adopt().
        self.arg_state: tuple = ()
        self.cell_slots = None
        # The rest of the guard.
        self.grad_enabled = True
        self.default_dtype = torch.float32
        self.autocast = (False, None)  # see autocast_state
        self.flag_modules: list = []
        self.flag_values: list = []
        self.flags_after: list = []  # (module, training) the step sets
        self.arg_flags_after: list = []  # (ArgSlot, requires_grad) the step sets
        self.settings_after: list = []  # (dict, key, value): Python settings the step sets
        self.groups: list = []  # (optimizer, hyper-parameters per group)
        # Each module's Python settings: (its __dict__, name), their values, types and names.
        self.settings: list = []
        self.setting_values: list = []
        self.setting_types: list = []
        self.setting_names: list = []
        self.sized: list = []  # dicts whose sizes are part of the state's form
        self.sizes: list = []
        self.size_names: list = []
        # Objects compared by identity (see [Note: what the step reaches] in record.py): those in
        # ``container.get(key)`` for each binding, and the entries of each held dict or list.
        self.bindings: list = []
        self.bound: list = []
        self.binding_names: list = []
        self._bound: set = set()  # (id(container), key) of each binding
        self.held: list = []  # the entries (a dict's values view, or the list itself)
        self.held_values: list = []  # all of them, flat
        self.held_names: list = []  # (name, how many entries it had)
        # The parameters, and their gradient hook dicts (``_TENSOR_HOOKS``) when recorded.
        self.hook_owners: list = []
        self.hook_values: list = []
        # (weak reference, version, shape) of each storage holding data the program built in
        self.constant_storages: list = []
        # The same for the CPU tensors the step read (see [Note: host tensors a step reads]).
        self.host_tensors: list = []
        # Slots holding a parameter (or a loose leaf tensor requiring grad: see state_slots)
        # when the step was recorded: slot -> that tensor. Its gradient and optimizer state were
        # found through the object, so another one there is another program.
        self.parameters: dict = {}
        # Slots whose form after the step differs from the form the step reads (the first step
        # creates optimizer state): the guard never takes their objects on trust.
        self.unsteady: list[int] = []
        self.requires_grad: list = []  # per slot, whether the tensor recorded there requires grad
        self.optimizers: list = []
        # Each optimizer's ``state`` and per-parameter state dicts when the getters were made.
        self.state_objects: list = []
        self.getters = None
        # Packed state (see [Note: packed state] in packing.py): the plain program's traced
        # function and XLA options until the first replay plans the packs; then a packing.Packed,
        # or False; per pack, its layout and (slot, reference count) per member; the packs the
        # last call stored; those the running call passes as they were (else None); per pack,
        # (member, node maker, targets) of its outputs.
        self.plain = None
        self.packed = None
        self.pack_slots: list = []
        self.packs: list = []
        self.passed: list = []
        self.pack_plan: list = []
        self.new_packs = None  # the packed arrays the running call returned

    # -- the objects the program expects

    def adopt(self, i: int, obj) -> None:
        """``obj`` is now in slot ``i`` (as the program left it, or compared equal in form)."""
        self.expect[i] = obj
        self.cell_slots = None
        tensor = api.is_device_tensor(obj)
        self.source[i] = api.storage(obj) if tensor else None
        self.storage[i] = self.source[i] if tensor and not api.is_view(obj) else None
        if self.expect_version[i] is not None and tensor:  # an input: the data it reads
            self.expect_version[i] = api.storage_version(self.source[i])

    def measure_refs(self) -> None:
        for _, i in self.donated:
            node = api.storage_value(self.source[i])
            # run() counts with ``node`` a local variable, as here.
            self.base_refs[i] = (sys.getrefcount(node), sys.getrefcount(node.payload))

    # -- the guard (see [Note: the guard])

    def check(self, args) -> str | None:
        """None when this program can run now, else what differs (for the log line)."""
        if torch.is_grad_enabled() is not self.grad_enabled:
            return f"grad mode: {self.grad_enabled} -> {torch.is_grad_enabled()}"
        if torch.get_default_dtype() is not self.default_dtype:  # factories' dtype, promotion
            return f"default dtype: {self.default_dtype} -> {torch.get_default_dtype()}"
        if autocast_state() != self.autocast:
            return f"autocast (enabled, dtype): {self.autocast} -> {autocast_state()}"
        if [m.training for m in self.flag_modules] != self.flag_values:
            for m, v in zip(self.flag_modules, self.flag_values):
                if m.training != v:
                    return f"{type(m).__name__}.training: {v} -> {m.training}"
        if self.settings:
            now = [d.get(k, _MISSING) for d, k in self.settings]
            # The same objects first: settings are immutable, and this reads none of them.
            if not _same_objects(now, self.setting_values) and (
                    now != self.setting_values or list(map(type, now)) != self.setting_types):
                reason = self._setting_difference(now)
                if reason:
                    return reason
        for opt, settings in self.groups:
            reason = _group_difference(opt, settings)
            if reason:
                return reason
        if self.bindings and not _same_objects([d.get(k, _MISSING) for d, k in self.bindings],
                                               self.bound):
            return self._binding_difference()
        if self.held and not _same_objects(list(chain.from_iterable(self.held)),
                                           self.held_values):
            return self._held_difference()
        if self.hook_owners and list(map(_TENSOR_HOOKS, self.hook_owners)) != self.hook_values:
            return self._hook_difference()
        for ref, written, shape in self.constant_storages:
            storage = ref()
            if storage is None or api.storage_version(storage) != written:
                return (f"a device tensor{list(shape)} the step reads as a constant (not an "
                        f"argument, parameter, buffer or optimizer state) was "
                        f"{'freed (replaced by another?)' if storage is None else 'written'}")
        if self.host_tensors:
            reason = host.changed(self.host_tensors)
            if reason:
                return reason
        if list(map(len, self.sized)) != self.sizes:
            for d, n, name in zip(self.sized, self.sizes, self.size_names):
                if len(d) != n:
                    return f"number of {name}: {n} -> {len(d)}"
        for slot in self.arg_slots:
            slot.leaves = args.leaves
        getters = self.getters
        if not _same_objects(self._state_objects(), self.state_objects):
            getters = None  # optimizer state replaced (load_state_dict, clear()): slow lookups
            for slot in self.slots:
                slot.forget()
        if getters is None:
            getters = [self.slots[i].get for i in self.guarded]
        expect, expect_version, source = self.expect, self.expect_version, self.source
        requires_grad = self.requires_grad
        version, storage = api.storage_version, api.storage
        stale = None
        for i, get in zip(self.guarded, getters):
            obj = get()
            if obj is expect[i]:
                cell = source[i]
                if cell is None:  # None or a host value
                    continue
                # The same tensor, still on the same storage (``t.data = other`` moves it) and
                # still (not) requiring grad (``requires_grad_(False)`` freezes a parameter).
                if storage(obj) is cell and obj.requires_grad is requires_grad[i]:
                    written = expect_version[i]
                    if written is None or version(cell) == written:
                        continue
            if stale is None:
                stale = []
            stale.append(i)
        if stale:
            reason = self._recheck(stale)
            if reason is not None:
                return reason
            if getters is not self.getters:
                self.refresh_getters()
        arg_state = self._arg_state()
        if arg_state != self.arg_state:
            return self._arg_state_difference(arg_state)
        return self._check_shared() if self.shared else None

    def _arg_state(self) -> tuple:
        """Per argument slot, the state slot whose storage its tensor is (None when none): a
        write through either is seen through the other, which the program was recorded for or
        not."""
        cells = self.cell_slots
        if cells is None:
            cells = self.cell_slots = {id(c): i for i, c in enumerate(self.source)
                                       if c is not None}
        storage, is_tensor = api.storage, api.is_device_tensor
        return tuple(cells.get(id(storage(obj))) if is_tensor(obj) else None
                     for obj in (slot.get() for slot in self.arg_slots))

    def _arg_state_difference(self, now) -> str:
        for slot, was, new in zip(self.arg_slots, self.arg_state, now):
            if was != new:
                return (f"{slot.name} shares its storage with "
                        f"{'nothing' if was is None else self.slots[was].name} -> "
                        f"{'nothing' if new is None else self.slots[new].name}")
        return "arguments sharing state"

    def _check_shared(self) -> str | None:
        """None when the slots that held one input's data when the step was recorded still hold
        the same data node (see [Note: slots sharing data]), else which slot differs."""
        source = self.source
        for i, others in self.shared:
            cell, node = source[i], self._data_in(i)
            for j in others:
                if (cell is None or source[j] is not cell) and self._data_in(j) is not node:
                    return (f"{self.slots[j].name} no longer holds the same data as "
                            f"{self.slots[i].name}, as when the step was recorded")
        return None

    def _data_in(self, i: int):
        cell = self.source[i]
        if cell is None:  # an argument (or a slot now holding no tensor)
            obj = self.slots[i].get()
            if not api.is_device_tensor(obj):
                return None
            cell = api.storage(obj)
        return api.storage_value(cell)

    def bind(self, container, key, name: str) -> None:
        if (id(container), key) in self._bound:  # reached through several paths
            return
        self._bound.add((id(container), key))
        self.bindings.append((container, key))
        self.bound.append(container.get(key, _MISSING))
        self.binding_names.append(name)

    def hold(self, entries, name: str) -> None:
        if not entries:  # the same entries while it stays empty: only its size is compared
            self.sized.append(entries)
            self.sizes.append(0)
            self.size_names.append(name)
            return
        entries = entries.values() if isinstance(entries, dict) else entries
        self.held.append(entries)
        self.held_values += entries
        self.held_names.append((name, len(entries)))

    def _binding_difference(self) -> str:
        for (d, k), was, name in zip(self.bindings, self.bound, self.binding_names):
            now = d.get(k, _MISSING)
            if now is not was:
                return f"{name} is another object: {_short(was)} -> {_short(now)}"
        return "bindings"

    def _held_difference(self) -> str:
        start = 0
        for entries, (name, n) in zip(self.held, self.held_names):
            was = self.held_values[start:start + n]
            start += n
            now = list(entries)
            if _same_objects(now, was):
                continue
            if len(now) != len(was):
                return f"number of {name}: {len(was)} -> {len(now)}"
            k = next(k for k, (a, b) in enumerate(zip(was, now)) if a is not b)
            key = list(entries.mapping)[k] if hasattr(entries, "mapping") else k
            return f"{name}, entry {key!r}: {_short(was[k])} -> {_short(now[k])}"
        return "held objects"

    def _parameter_names(self) -> dict:
        return {id(p): self.slots[i].name for i, p in self.parameters.items()}

    def _hook_difference(self) -> str:
        names = self._parameter_names()
        for p, was in zip(self.hook_owners, self.hook_values):
            for kind, a, b in zip(_HOOK_KINDS, was, _TENSOR_HOOKS(p)):
                if a is not b:
                    return f"{kind} of {names[id(p)]}: {'none' if a is None else 'some'} -> " \
                           f"{'none' if b is None else len(b)}"
        return "gradient hooks"

    def _setting_difference(self, now) -> str | None:
        for v, was, name in zip(now, self.setting_values, self.setting_names):
            if not same_value(v, was):
                return f"{name}: {was!r} -> {'(deleted)' if v is _MISSING else repr(v)}"
        self.setting_values = now  # equal values in new objects (a nan, a float set anew)
        return None

    def refresh_getters(self) -> None:
        """Fast lookups of the guarded slots, valid while the optimizers' state dicts stay."""
        self.state_objects = self._state_objects()
        self.getters = [self.slots[i].fast_get() for i in self.guarded]

    def _state_objects(self) -> list:
        objects = [opt.state for opt in self.optimizers]
        for state in objects[:]:
            objects += state.values()
        return objects

    def _recheck(self, stale) -> str | None:
        parameters = self.parameters
        for i in stale:
            if i in parameters and self.slots[i].get() is not parameters[i]:
                return (f"{self.slots[i].name} is another tensor object than the parameter it "
                        f"held when the step was recorded")
        specs = [spec_of(self.slots[i].get()) for i in stale]
        if any(s is not None and s[0] == "tensor" and s[6] == "pending" for s in specs):
            api.sync()  # the state was changed lazily since the last call: compute it first
            specs = [spec_of(self.slots[i].get()) for i in stale]
        for i, spec in zip(stale, specs):
            if spec != self.specs[i]:
                return difference(self.slots[i].name, self.specs[i], spec)
        for i in stale:
            self.adopt(i, self.slots[i].get())
        return None

    # -- running

    def run(self, args):
        if self.packed is None:
            self._plan_packs()
        source, slots, value = self.source, self.slots, api.storage_value
        getrefcount = sys.getrefcount
        fresh = None
        for position, i in self.donated:  # before ``values`` holds the arrays too
            node = value(source[i])
            base = self.base_refs[i]
            if getrefcount(node) != base[0] or getrefcount(node.payload) != base[1]:
                fresh = (fresh or []) + [position]
        values = list(self.constant_values)
        for position, i in self.state_inputs:
            values[position] = value(source[i]).payload
        for kind, position, a, b in self.other_inputs:
            if kind == "arg":
                values[position] = value(api.storage(slots[a].get())).payload
            elif kind == "lr":
                values[position] = a.array()
            else:  # a Python number
                values[position] = np.asarray(args.leaves[a], b)
        if self.draws:
            seed, counter = self.position = rng.advance(self.draws)
            if self.random_inputs:
                self._feed_stream(values, seed, counter)
        for position, i, arg, new in self.moves:
            node = value(api.storage(slots[i].get()) if arg else source[i])
            values[position] = placement.placed(node, values[position], new)
        for position in fresh or ():
            values[position] = _copy(values[position])
        results = self.execute(values, self.graph, self._scalars)
        del values
        return self.store(results)

    def _plan_packs(self) -> None:
        """At the first replay: which consumed state goes in packs (see [Note: packed state]) and
        which numbers are built in (see [Note: numbers built into a replay] in packing.py)."""
        self.packed = False
        if self.plain is None:
            return
        write_to = {i: position for position, _, targets in self.write_plan for i, _ in targets}
        kept = {a for k, a, _ in self.returns[1] if k == "new"} | set(self.placement) | set(
            self.handles)
        pairs, seen, unsteady = [], set(), set(self.unsteady)
        for p, i in self.donated:
            q = write_to.get(i)
            if q is not None and q not in kept and q not in seen and i not in unsteady:
                pairs.append((p, q))
                seen.add(q)
        values = {p: api.storage_value(self.source[i]).payload for p, i in self.donated}
        outputs = self.executable.compiled.out_info
        layouts = packing.plan(values, outputs, pairs)
        fixed = self.fixed_numbers
        if packing.Packed.saves(layouts, fixed, self.random_inputs) < packing.MIN_PACKED:
            self.plain = None
            return
        self.packed = packing.Packed(layouts, len(self.inputs), len(outputs), fixed,
                                     self.random_inputs)
        self.random_inputs = []  # the stream's numbers are read from one array (see execute)
        slot_of = dict(self.donated)
        packed_in = {m.input for layout in layouts for m in layout.members}
        self.packs = [None] * len(layouts)
        self.passed = [None] * len(layouts)
        plan = {position: (maker, targets) for position, maker, targets in self.write_plan}
        self.pack_plan, self.pack_slots = [], []
        for layout in layouts:
            entries = []
            for k, m in enumerate(layout.members):
                targets = plan[m.output][1]
                w = targets[0][1]
                entries.append((k, ir.packed_data_maker(w.shape, w.dtype, w.sharding), targets))
            self.pack_plan.append((layout, entries))
            members = [slot_of[m.input] for m in layout.members]
            # Whether each member goes back to its own slot only: its node can then move on.
            movable = all(len(targets) == 1 and targets[0][0] == i
                          for i, (_, _, targets) in zip(members, entries))
            self.pack_slots.append((layout, [(i, self.base_refs[i][0]) for i in members],
                                    movable))
        packed_out = {m.output for layout in layouts for m in layout.members}
        self.write_plan = [e for e in self.write_plan if e[0] not in packed_out]
        self.donated = [(p, i) for p, i in self.donated if p not in packed_in]
        self.state_inputs = [(p, i) for p, i in self.state_inputs if p not in packed_in]
        # A member is the program's own result, already on its devices: nothing to move.
        self.moves = [m for m in self.moves if m[0] not in packed_in]

    def _packs(self) -> list:
        """This call's packed arrays: those the last call stored, when their members are still
        in place and held by nothing else, else packed anew from the members."""
        source, storage = self.source, self.storage
        value, getrefcount = api.storage_value, sys.getrefcount
        arrays = []
        for g, (layout, members, movable) in enumerate(self.pack_slots):
            pack = self.packs[g]
            intact = pack is not None and pack.array is not None
            for k, (i, base) in enumerate(members):
                if not intact:
                    break
                node = value(source[i])
                # A node held elsewhere keeps its value: packing anew reads (cuts) every member.
                if type(node) is not ir.PackedData or node.pack is not pack or \
                        node.member != k or getrefcount(node) != base:
                    intact = False
                elif storage[i] is not source[i]:  # a view now: the node stays
                    movable = False
            arrays.append(pack.array if intact else
                          layout.pack([value(source[i]).payload for i, _ in members]))
            self.passed[g] = pack if intact and movable else None
            self.packs[g] = None
        return arrays

    def _feed_stream(self, values, seed: int, counter: int) -> None:
        """The stream's seed and each draw's counter (see [Note: random draws in a compiled step]
        in record.py)."""
        if seed != self.seed:
            self.seed, self.seed_array = seed, np.asarray(seed, np.uint64)
        seed_array = self.seed_array
        for position, offset, dtype in self.random_inputs:
            values[position] = seed_array if offset is None else \
                np.asarray((counter + offset) & rng.MASK, dtype)

    def execute(self, values: list, graph, scalars) -> tuple:
        """Calls the executable on ``values`` (consuming what it donates), as every execution is:
        checked across processes first, timed in metrics and on a profiler's timeline."""
        if graph is not None:  # a multi-process run (see record.py)
            divergence.before_run(self.executable, graph, "compiled step",
                                  scalars and (lambda: scalars(values)))
        for position in self.copied:
            values[position] = _copy(values[position])
        packed = self.packed
        if packed:
            packs = self._packs()
            stream = packed.stream_array(*self.position) if packed.stream else None
            if packed.compiled is None:
                inner, options = self.plain
                packed.compile(inner, options, packs, values, stream,
                               [p for p, _ in self.donated], self.executable.compiled, self.name)
                self.compiled, self.plain = packed.compiled, None
            with trace.phase(trace.EXECUTE):
                out = self.compiled(*packs, *[values[p] for p in packed.inputs],
                                    *(() if stream is None else (stream,)))
            del packs
            self.new_packs, results = packed.results(out)
        else:
            with trace.phase(trace.EXECUTE):
                results = self.compiled(*values)
        compiler.dispatched(self.compiled, results, self.handles)
        return results

    def _scalars(self, values) -> list:
        """The Python numbers this call runs on, for the multi-process check: the stream's, the
        learning rates, the numbers passed, the constants'."""
        out = []
        for position, (kind, a, b) in enumerate(self.inputs):
            if kind == "random":
                seed, counter = self.position
                out.append(seed if a is None else (counter + a) & rng.MASK)
            elif kind == "number":
                out.append(values[position].item())
            elif kind == "lr":
                out.append(a.host())
            elif kind == "constant" and b is not None:
                out.append(b)
        return out

    def prepare(self) -> None:
        """Splits ``inputs`` by kind for ``run`` (constants go in place once)."""
        self.constant_values = [a if kind == "constant" else None for kind, a, _ in self.inputs]
        self.state_inputs = [(p, a) for p, (kind, a, _) in enumerate(self.inputs)
                             if kind == "state"]
        self.other_inputs = [(kind, p, a, b) for p, (kind, a, b) in enumerate(self.inputs)
                             if kind in ("arg", "lr", "number")]
        self.random_inputs = [(p, a, b) for p, (kind, a, b) in enumerate(self.inputs)
                              if kind == "random"]
        # The constant numbers a replay executable builds in (see [Note: numbers built into a
        # replay] in packing.py): position -> the 0-d value.
        self.fixed_numbers = {p: np.asarray(b, a.dtype) for p, (kind, a, b) in
                              enumerate(self.inputs) if kind == "constant" and b is not None}

    def store(self, results):
        if self.placement:
            results = list(results)
            for position in self.placement:
                results[position] = api.placed(results[position])
        slots, plan = self.slots, self.write_plan
        if plan is None:  # the recording call: each Write makes its node maker from the array
            nodes = {}  # one data node per output, however many slots it goes to
            for w in self.writes:
                node = nodes.get(w.position)
                if node is None:
                    node = nodes[w.position] = w.node(results[w.position])
                self._store(w, node)
        else:
            for position, maker, targets in plan:
                self._write(maker(results[position]), targets)
            if self.new_packs is not None:
                self._store_packs()
        for i in self.clears:
            if slots[i].get() is not None:
                slots[i].set(None)
            self.expect[i] = self.storage[i] = self.source[i] = None
        for i in self.unsteady:
            self.expect[i] = _UNSTEADY
        for module, training in self.flags_after:
            module.training = training
        for slot, flag in self.arg_flags_after:
            slot.get().requires_grad_(flag)
        for container, key, value in self.settings_after:
            container[key] = value
        treedef, returns = self.returns
        out = []
        bases = None  # output position -> the tensor holding it, for returns sharing a storage
        for kind, a, b in returns:
            if kind == "new":
                shape, dtype, view = b
                if view is None:
                    out.append(api.new_tensor(api.data_node(results[a], shape, dtype)))
                    continue
                bases = bases or {}
                base = bases.get(a)
                if base is None:
                    base = bases[a] = api.new_tensor(api.data_node(results[a], shape, dtype))
                out.append(api.view_of(base, view))
            elif kind == "slot":
                out.append(slots[a].get())
            elif kind == "view":
                out.append(api.view_of(slots[a].get(), b))
            elif kind == "same":
                out.append(out[a])
            else:
                out.append(a)
        return pytree.tree_unflatten(out, treedef)

    def _write(self, node, targets) -> None:
        """Writes ``node`` into the slots of ``targets`` (``(slot, Write)`` pairs)."""
        storage, expect_version = self.storage, self.expect_version
        for i, w in targets:
            target = storage[i]
            if target is not None:  # the guard saw the object the program left there
                api.write_data(target, node)
                if expect_version[i] is not None:
                    expect_version[i] = api.storage_version(target)
            else:
                self._store(w, node)

    def _store_packs(self) -> None:
        """Stores the packed arrays the call returned: into the members' nodes of the pack it
        consumed when it passed that pack as it was, else into a new ``PackedData`` node per
        member (see [Note: packed state] in packing.py)."""
        arrays, self.new_packs = self.new_packs, None
        for g, ((layout, entries), array) in enumerate(zip(self.pack_plan, arrays)):
            pack = packing.Pack(array, layout)
            passed, self.passed[g] = self.passed[g], None
            if passed is not None:
                self._move_nodes(passed, pack, self.pack_slots[g][1])
            else:
                nodes = [make(pack, k) for k, make, _ in entries]
                for node, (_, _, targets) in zip(nodes, entries):
                    self._write(node, targets)
                pack.hold(nodes)
            self.packs[g] = pack

    def _move_nodes(self, passed, pack, members) -> None:
        """Points the members' nodes of ``passed``, the pack the call consumed as it was (each
        node in its slot's storage alone: see ``_packs``), at ``pack``, and counts a write in
        each storage."""
        for ref in passed.nodes:
            ref().move_to(pack)
        pack.nodes, passed.nodes = passed.nodes, ()
        storage, expect_version, version = self.storage, self.expect_version, api.storage_version
        for i, _ in members:
            api.count_write(storage[i])
            if expect_version[i] is not None:
                expect_version[i] = version(storage[i])

    def _store(self, w: Write, node) -> None:
        """Stores ``node`` (output ``w.position``) into its slot, whatever the slot holds now."""
        i, slots = w.slot, self.slots
        target = self.storage[i]
        if target is None and i in self.arg_writes:  # this call's argument, changed
            arg = slots[i].get()
            target = api.storage(arg)
            if w.annotation is not None and api.annotation(arg) is not w.annotation:
                api.set_annotation(arg, w.annotation)
        if target is not None:  # the guard saw the object the program left there
            api.write_data(target, node)
            if self.expect_version[i] is not None:
                self.expect_version[i] = api.storage_version(target)
        else:  # a slot the step fills with a new tensor
            obj = api.new_tensor(node, w.annotation)
            slots[i].set(obj)
            self.adopt(i, obj)

    def measure_after_first_store(self) -> None:
        """After the recording call stored its results: the objects it left, the slots whose form
        changed, and the reference counts of what it stored."""
        for i, s in enumerate(self.slots):
            if not isinstance(s, st.ArgSlot):
                self.adopt(i, s.get())
        owners = {id(s.param) for s in self.slots if isinstance(s, st.GradSlot)}
        self.parameters = {i: self.expect[i] for i, s in enumerate(self.slots)
                           if s.key[0] in ("param", "group_param", "cell", "entry")
                           and self.expect[i] is not None and id(self.expect[i]) in owners}
        # Hooks on a parameter's gradient (``p.register_hook``, post-accumulate-grad hooks) ran
        # while the step was recorded: one registered or removed since is another program.
        self.hook_owners = list({id(p): p for p in self.parameters.values()}.values())
        self.hook_values = list(map(_TENSOR_HOOKS, self.hook_owners))
        names = self._parameter_names()
        for p, hooks in zip(self.hook_owners, self.hook_values):
            for kind, entries in zip(_HOOK_KINDS, hooks):
                if entries is not None:
                    self.hold(entries, f"{kind} of {names[id(p)]}")
        self.unsteady = [i for i in self.guarded if spec_of(self.expect[i]) != self.specs[i]]
        self.requires_grad = [s is not None and s[0] == "tensor" and s[3] for s in self.specs]
        self.arg_state = self._arg_state()
        self.measure_refs()
        self.refresh_getters()
        targets = {}
        for w in self.writes:
            targets.setdefault(w.position, []).append((w.slot, w))
        self.write_plan = [(position, ws[0][1].maker, ws) for position, ws in targets.items()]
        for i in self.unsteady:
            self.expect[i] = _UNSTEADY


def _short(obj) -> str:
    if obj is _MISSING:
        return "(deleted)"
    name = getattr(obj, "__qualname__", None) or type(obj).__name__
    return f"{name} at {id(obj):#x}"


def _same_objects(a: list, b: list) -> bool:
    """Whether ``a`` and ``b`` hold the same objects (by identity: ``==`` on dicts compares the
    tensors in them by value)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def autocast_state() -> tuple:
    """Whether ``torch.autocast`` is on for the device, and its dtype (None when off): which
    casts a recorded step holds."""
    if torch.is_autocast_enabled(api.DEVICE_TYPE):
        return (True, torch.get_autocast_dtype(api.DEVICE_TYPE))
    return (False, None)


_UNSTEADY = object()  # an object no slot holds
_MISSING = object()  # a setting deleted since the step was recorded


def _group_difference(opt, settings) -> str | None:
    groups = opt.param_groups
    if len(groups) != len(settings):
        return f"number of optimizer param groups: {len(settings)} -> {len(groups)}"
    for g, (group, recorded) in enumerate(zip(groups, settings)):
        if len(group) != len(recorded) + 1:
            return f"optimizer param_groups[{g}] keys: {sorted(recorded)} -> {sorted(group)}"
        for k, v in recorded.items():
            now = group.get(k)
            same = v.matches(now) if isinstance(v, optim_support.RateRecord) else (
                now is v or same_value(now, v))
            if not same:
                return f"optimizer param_groups[{g}][{k!r}]: {v!r} -> {now!r}"
    return None
