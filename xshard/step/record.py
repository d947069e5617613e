"""Recording a step once on the lazy tracer, and the program made from the recording.

[Note: trace once]
The step function runs on the lazy tracer exactly as it would on the lazy path, with two
differences: a capture is open (xshard.core.capture: nothing may read a value or run on the CPU),
and every storage the step can reach (see xshard.step.state) first has its device data wrapped in
an input node (an ``aten.alias`` of the data: an identity), so that everything the step does to it
is pending work, never done at once (a ``mark_sharding`` of an argument becomes a constraint in the
graph, not a copy made now). When the function returns, the pending values of those storages and
of the returned tensors are the outputs of one graph, whose inputs are the storages' data, the
learning rates and Python-number arguments (see optim.py), the random stream's numbers (see
[Note: random draws in a compiled step]) and constants. That graph is lowered through the lowering
table and compiled as a sync's graph is (same cache, compiler options and metrics; the executable
is named after the step function), run once for this call, and kept as a ``Program``.

Why the lazy tracer and not ``make_fx`` over fake stand-ins (the probe of the design notes): FSDP's
hooks, ``mark_sharding``, optimisation barriers, the random stream and the fused attention all work
on xshard tensors and would each need a second implementation for fakes; recorded on xshard tensors
the step is exactly the lazy path's graph, lowered through the same table, so the compiled step
equals the lazy path by construction. The recording costs one lazy step, once.

Python in the step runs only while it is recorded, as in ``jax.jit``: prints, counters, anything
that does not reach a tensor happens once. What would make the program wrong is refused instead,
naming the user's line: reading a value, an op that would run on the CPU, changing an optimizer's
settings or its Python-valued state, stepping a scheduler, seeding the random stream. After a
refusal the state is as it was.

[Note: random draws in a compiled step]
The random stream is a seed and a counter on the host (see [Note: the random stream] in
xshard.core.rng): each random op recorded takes the stream's seed and the counter's value as two
scalar inputs of its ``RNG_KEY`` node, and advances the counter. A recording that starts at counter
``c0`` and draws ``n`` times gives the program the counter inputs ``c0 + k`` (one per draw; several
nodes share a ``k`` when activation checkpointing restores the stream to recompute with the
forward's masks). A replay starting at counter ``c`` feeds the current seed and ``c + k`` for each,
and advances the counter by ``n``: exactly the draws the lazy path makes from the same seed and
position, so a compiled step and the lazy path draw the same masks, every call draws new ones, and
``torch.manual_seed`` reproduces them.
"""

from __future__ import annotations

from collections import Counter
import sys
import warnings
import weakref

import numpy as np
import torch
import torch.utils._pytree as pytree

from xshard.core import api, arrays, capture, compiler, execute, ir, rng, runtime, trace
from xshard.core.dtypes import to_numpy_dtype
from xshard.core.graph import Graph, same_values
from xshard.step import host
from xshard.step import optim as optim_support
from xshard.step import packing
from xshard.step import state as st
from xshard.step.errors import (CaptureError, CompileError, StateError, user_line,
                                 user_stacklevel)
from xshard.step.program import (Program, Rate, Write, autocast_state, describe, same_value,
                                 spec_of)

_ALIAS = torch.ops.aten.alias.default


def _wrap(node: ir.Node) -> ir.Node:
    """A step's input: the storage's data seen through an identity, so that the storage's value
    is pending while the step is recorded (see [Note: trace once])."""
    return ir.Node(_ALIAS, (node,), ((ir.slot(0),), ()), node.shape, node.dtype)


class _Owner:
    """The capture's owner while a step is recorded: refuses reads and CPU ops."""

    def __init__(self, compiled, numbers: bool, rates, stepping):
        self.compiled = compiled
        self.numbers = numbers  # whether Python numbers were passed (as 0-d tensors)
        self.rates = rates  # the lifted learning rates (see optim.py)
        self.stepping = stepping  # the optimizer whose step runs now, if one does

    def on_read(self, what: str, tensor) -> bool:
        read = optim_support.rates_read(tensor, self.rates) if tensor is not None else ()
        if read:  # a number computed from learning rates: built into the program, and guarded
            for rate in read:
                rate.read_at = rate.read_at or user_line()
            return True
        hint = (" A Python number argument is a 0-d tensor inside the step: if the step uses it "
                "as a number (range(n), if flag), make it static (static_argnums= or "
                "static_argnames=)." if self.numbers else "")
        if _in_grad_scaler_step():
            hint += (" The read is GradScaler.step asking whether the gradients overflowed, "
                     "which it leaves to the optimizer when the optimizer is fused: pass "
                     "fused=True to the optimizer (SGD, Adam, AdamW, Adagrad).")
        elif self.stepping:
            opt = self.stepping[0]
            hint += (f" The read is in {type(opt).__name__}.step, which reads a tensor as a "
                     f"Python number" +
                     (" in its for-loop form: pass foreach=True." if opt.defaults.get("foreach")
                      is not True and "foreach" in opt.defaults else "."))
        raise CaptureError(
            f"xshard.compile({self.compiled.name}): {what} at {user_line()}. Inside a compiled "
            f"step tensors have no values yet: the step is recorded once and replayed without "
            f"running its Python, so it cannot print a tensor, call .item() or branch on a "
            f"tensor's value. Return the tensor and read it after the call (or branch with "
            f"torch.where), or run this step without xshard.compile (the lazy path).{hint}")

    def on_fallback(self, op) -> None:
        raise CaptureError(
            f"xshard.compile({self.compiled.name}): {op} has no lowering rule (at {user_line()}); "
            f"the lazy path runs it eagerly on the CPU, which a compiled step cannot do. Run this "
            f"step without xshard.compile, or replace the op.")

    def on_sync(self) -> None:
        if not self.compiled.warned_sync:
            self.compiled.warned_sync = True
            warnings.warn(
                f"xshard.compile({self.compiled.name}): xshard.sync() inside a compiled step does "
                f"nothing (the whole step is one graph); at {user_line()}.",
                stacklevel=user_stacklevel())


def _in_grad_scaler_step() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _GRAD_SCALER_STEP:
            return True
        frame = frame.f_back
    return False


_GRAD_SCALER_STEP = torch.amp.GradScaler.step.__code__


class Recording:
    """One recording of the step: its entry state, the run, and the program built from it."""

    def __init__(self, compiled, args, call_args, call_kwargs):
        self.compiled = compiled
        self.args = args  # the Arguments of this call
        self.call_args, self.call_kwargs = call_args, call_kwargs
        self.returned = []  # weak references to the storages of the tensors the step returned

    def run(self):
        compiled, args = self.compiled, self.args
        name = compiled.name
        api.sync()  # work pending from before the step is not part of it
        roots = st.find_roots(compiled.fn, list(compiled.state) + args.roots())
        optim_support.make_capturable(roots.optimizers)
        api.sync()
        leaves = list(args.leaves)
        for i in args.tensor_positions():
            if leaves[i].grad_fn is not None:
                raise StateError(
                    f"xshard.compile({name}): {args.name(i)} has autograd history from outside "
                    f"the step (grad_fn={type(leaves[i].grad_fn).__name__}): a replay cannot "
                    f"backpropagate into the graph that made it, or into the tensors it came from. "
                    f"Pass it detached (x.detach(), then requires_grad_() inside the step if the "
                    f"step needs its gradient), or run this step without xshard.compile.")
        arg_slots = []
        for i in args.tensor_positions():
            slot = st.ArgSlot(i, args.name(i))
            slot.leaves = leaves
            arg_slots.append(slot)
        slots = st.state_slots(roots)
        slots = arg_slots + slots + _arg_grad_slots(arg_slots, leaves, slots)
        entry = [s.get() for s in slots]
        arg_flags = [leaves[s.index].requires_grad for s in arg_slots]
        specs = [spec_of(o) for o in entry]
        self._refuse_partial_sums(slots, entry)
        self._share_equal_scalars(slots, entry, compiled.unjoined)
        program = Program(name)
        program.grad_enabled = torch.is_grad_enabled()
        program.default_dtype = torch.get_default_dtype()
        program.autocast = autocast_state()
        # Each module once (an FSDP unit is a root of its own, and a submodule of the model).
        program.flag_modules = list({id(m): m for root in roots.modules
                                     for m in root.modules()}.values())
        program.flag_values = [m.training for m in program.flag_modules]
        program.groups = [(opt, optim_support.hyperparameters(opt)) for opt in roots.optimizers]
        program.optimizers = list(roots.optimizers)
        self._record_sizes(program, roots)
        host_values = {s.key: spec for s, spec in zip(slots, specs)
                       if spec is not None and spec[0] != "tensor"}

        # Learning rates and Python numbers become device inputs (see optim.py).
        rates = optim_support.lift_rates(roots.optimizers)
        numbers = {}
        for i in args.number_positions():
            # A tensor standing for the number (see [Note: numbers in a graph] in
            # xshard.core.record): it promotes as the number, in its own precision.
            value = leaves[i]
            data = api.upload(torch.tensor(value, dtype=torch.float64 if type(value) is float
                                           else torch.int64))
            leaves[i] = api.new_tensor(ir.weak(data))
            numbers[id(data)] = (i, to_numpy_dtype(data.dtype), api.storage(leaves[i]))

        wrapped = {}  # id(storage) -> (storage, entry node, wrapper node)
        for obj in entry:
            if api.is_device_tensor(obj):
                storage = api.storage(obj)
                if id(storage) not in wrapped:
                    node = api.storage_value(storage)
                    wrapper = _wrap(node)
                    api.write_storage(storage, wrapper)
                    wrapped[id(storage)] = (storage, node, wrapper)

        fn_args, fn_kwargs = args.rebuild(leaves, self.call_args, self.call_kwargs)
        saved_state = [(opt, {p: dict(d) for p, d in opt.state.items()})
                       for opt in roots.optimizers]
        stream = rng.position()  # see [Note: random draws in a compiled step]
        settings, before = [], []
        try:
            settings = _settings(program.flag_modules, roots)
            before = [container.get(key, None) for container, key, _ in settings]
            host_reads = host.HostReads()
            cpu_stream = torch.default_generator.get_state()
            generators = host.Generators(self._reached(roots, program.flag_modules))
            with optim_support.graph_paths(roots.optimizers) as stepping, \
                    capture.capturing(_Owner(compiled, bool(numbers), rates, stepping)), \
                    host_reads:
                out = compiled.fn(*fn_args, **fn_kwargs)
            self._check_host_state(rates, program.groups, slots, host_values)
            if args.views or args.hosts:
                self._refuse_written_copies(leaves, wrapped)
            self._build_in_rates(rates, program.groups)
            program.draws = self._draws(stream)  # refuses a step seeding the streams first
            self._refuse_host_draws(cpu_stream, generators)
            for rate in rates:
                rate.restore()
            # The state that exists now (the first step creates the optimizer's).
            all_slots = st.merge_slots(slots, st.state_slots(roots))
            entry += [None] * (len(all_slots) - len(slots))
            specs += [None] * (len(all_slots) - len(slots))
            program.slots, program.arg_slots, program.specs = all_slots, arg_slots, specs
            program.guarded = [i for i, s in enumerate(all_slots)
                               if not isinstance(s, st.ArgSlot)]
            program.flags_after = [(m, m.training) for m, v in zip(program.flag_modules,
                                                                   program.flag_values)
                                   if m.training != v]
            program.arg_flags_after = [(s, not v) for s, v in zip(arg_slots, arg_flags)
                                       if leaves[s.index].requires_grad is not v]
            exits = [s.get() for s in all_slots]
            _record_settings(program, roots, settings, before)
            # _plan drops the result once it has read it: whatever its autograd graph keeps alive
            # (saved activations) is not state the step kept.
            result_box = [out]
            del out
            planned = self._plan(program, entry, exits, wrapped, rates, numbers, result_box,
                                 stream)
            # After _plan dropped the result: what its autograd graph held is gone.
            program.host_tensors = host_reads.guarded(name)
        except BaseException:
            self._undo(slots, entry, wrapped, rates, saved_state, program.groups)
            _put_back(settings, before)
            rng.set_position(*stream)
            raise
        result = self._first_run(program, planned, exits, wrapped)
        self._quarantine_returned_elsewhere()
        # Only what outlives the recording is guarded: what dies later was replaced. (Data made
        # inside the step, a CPU tensor ``.to(device)``, is a constant of its code.)
        program.constant_storages = [c for c in program.constant_storages if c[0]() is not None]
        program.host_tensors = [h for h in program.host_tensors if h[0]() is not None]
        constants = [shape for _, _, shape in program.constant_storages if shape]
        if constants:
            shapes = ", ".join(str(list(shape)) for shape in constants[:4])
            warnings.warn(
                f"xshard.compile({name}): the step reads {len(constants)} device tensor(s) that "
                f"are not arguments, parameters, buffers or optimizer state (shapes {shapes}); "
                f"their current values are built into the compiled step, which is recorded again "
                f"when one is changed or freed. Pass them as arguments, or register them as "
                f"buffers, if they change.", stacklevel=user_stacklevel())
        return program, result

    def _quarantine_returned_elsewhere(self) -> None:
        """A tensor the step returned that something else still holds (a list, an attribute of an
        object that is not state): its recorded value stays pending on inputs the program may
        have consumed, and a replay returns a new tensor without updating it. Reading it raises,
        and a sync leaves it out (it made the next call's sync fail on a deleted array)."""
        pending = {id(s) for s in api.pending_storages()}
        error = StateError(
            f"this tensor was returned by xshard.compile({self.compiled.name}) and is also held "
            f"elsewhere (a list, an attribute); a compiled step returns a new tensor on "
            f"each call and does not update this one. Use the tensor the call returned.")
        for ref in self.returned:
            storage = ref()
            if storage is not None and id(storage) in pending:
                api.quarantine(storage, error)
        self.returned = []

    # -- checks

    def _refuse_partial_sums(self, slots, entry):
        for slot, obj in zip(slots, entry):
            # After a sync, a value that is not device data is a partial sum.
            if api.is_device_tensor(obj) and api.storage_value(api.storage(obj)).op is not ir.DATA:
                raise StateError(
                    f"xshard.compile({self.compiled.name}): {slot.name} holds per-device partial "
                    f"sums (gradients accumulated under FSDP.no_sync()), which a compiled step "
                    f"cannot read. Run the steps that accumulate under no_sync, and the first one "
                    f"after it, without xshard.compile.")

    def _reached(self, roots, modules) -> list:
        """``(name, object)``: what the step reaches besides its state (for ``host.Generators``)."""
        reached = [(name, container.get(key, None)) for container, key, name in roots.bindings]
        reached += [(f"{type(m).__name__}.{k}", v) for m in modules for k, v in vars(m).items()]
        reached += [(self.args.name(i), leaf) for i, leaf in enumerate(self.args.leaves)]
        return reached

    def _refuse_host_draws(self, cpu_stream, generators) -> None:
        """Numbers drawn from the CPU generator inside the step (``torch.randn(4).to(dev)``,
        ``torch.randperm(n)``), or from Python's or NumPy's (see [Note: Python and NumPy random
        numbers in a step] in host.py), would be constants of the program: every replay would
        reuse the first call's. Refused, the generators put back (the lazy path then draws them
        once)."""
        moved = generators.moved()
        if moved:
            raise StateError(
                f"xshard.compile({self.compiled.name}): the step draws random numbers from "
                f"{' and '.join(moved)}; a replay runs none of the step's Python, so every call "
                f"would repeat the first call's numbers (the same choice each step). Draw them "
                f"on the device (torch.rand((), device=x.device) < p, then torch.where, or a "
                f"mask), where each call draws anew, or draw them outside the step and pass them "
                f"as arguments.")
        if torch.equal(torch.default_generator.get_state(), cpu_stream):
            return
        torch.default_generator.set_state(cpu_stream)
        raise StateError(
            f"xshard.compile({self.compiled.name}): the step draws random numbers on the CPU "
            f"(torch.randn(...) or torch.randperm(...) without a device, then moved): a compiled "
            f"step would reuse the first call's numbers on every call. Draw them on the device "
            f"(device=xshard.device(), or x.device), where each call draws anew, or pass them "
            f"as arguments.")

    def _refuse_written_copies(self, leaves, wrapped) -> None:
        """View and CPU tensor arguments are passed by value (copies, see compiled.Arguments):
        refused when the step writes one (or, for a view, the storage it views through another
        argument or the state), since eager would see the write through the view (or the base),
        or in the CPU tensor; and when the step fills the copy's gradient."""
        def written(cell):
            w = wrapped.get(id(cell))
            return w is not None and api.storage_value(cell) is not w[2]

        for i in sorted(self.args.hosts | set(self.args.views)):
            if leaves[i].grad is not None:
                what = "a CPU tensor" if i in self.args.hosts else "a view of another tensor"
                raise StateError(
                    f"xshard.compile({self.compiled.name}): {self.args.name(i)} is {what} that "
                    f"requires grad, and the step's backward() fills its gradient. A compiled "
                    f"step takes such an argument as a copy, so the gradient would not reach "
                    f"it. Pass it as a device tensor of its own (t.detach().to(xshard.device())"
                    f".requires_grad_()), or run this step without xshard.compile.")
        for i in sorted(self.args.hosts):
            if written(api.storage(leaves[i])):
                raise StateError(
                    f"xshard.compile({self.compiled.name}): {self.args.name(i)} is a CPU tensor "
                    f"and the step writes it in place. A compiled step runs on a device copy of a CPU argument, so the write would "
                    f"not reach the CPU tensor. Pass it on the device (t.to(xshard.device()): "
                    f"the step then updates it in place), or update it outside the step.")
        for i, view in self.args.views.items():
            if written(api.storage(leaves[i])) or written(api.storage(view)):
                raise StateError(
                    f"xshard.compile({self.compiled.name}): {self.args.name(i)} is a view of "
                    f"another tensor (x[1:3], x.t()), and the step writes it or the tensor it "
                    f"views in place. A compiled step takes a view argument as a copy, so the "
                    f"write would not reach the other. Pass the whole tensor and take the view "
                    f"inside the step, or pass a copy and copy it back (y = v.clone(); step(y); "
                    f"v.copy_(y)).")

    @staticmethod
    def _share_equal_scalars(slots, entry, unjoined) -> None:
        """0-d state of one value gets one data node, which the program then reads once (see
        [Note: slots sharing data] in program.py): AdamW's step counts after a checkpoint is
        loaded, BatchNorm's batch counts. Slots in ``unjoined`` (their shared data came apart
        after a call: a buffer counting calls in forward, equal to Adam's step count) are left
        apart; joined again, each call would record the step again."""
        first = {}
        for slot, obj in zip(slots, entry):
            if isinstance(slot, (st.ArgSlot, st.ArgGradSlot)) or not api.is_device_tensor(obj) \
                    or obj.dim() != 0 or api.is_view(obj) or slot.key in unjoined:
                continue
            storage = api.storage(obj)
            node = api.storage_value(storage)
            kept = first.setdefault(
                (obj.dtype, node.sharding, api.annotation(obj), ir.exact(obj.item())), node)
            if kept is not node:
                api.write_data(storage, kept)

    @staticmethod
    def _record_sizes(program: Program, roots) -> None:
        # Hooks run only while the step is recorded: one registered, removed or replaced since
        # makes another program; so does a submodule replaced (see [Note: what the step
        # reaches]).
        for m in program.flag_modules:
            name = type(m).__name__
            for kind in _MODULE_DICTS:
                program.sized.append(getattr(m, kind))
                program.size_names.append(f"{kind[1:].replace('_', ' ')} of the {name}")
            for kind in _MODULE_HELD:
                program.hold(getattr(m, kind), f"{kind[1:].replace('_', ' ')} of the {name}")
        for kind in _GLOBAL_HOOKS:
            program.hold(getattr(torch.nn.modules.module, kind),
                         f"global module hooks ({kind[8:].replace('_', ' ')})")
        for opt in roots.optimizers:
            program.sized.append(opt.state)
            program.size_names.append(f"parameters with state in the {type(opt).__name__}")
            for g, group in enumerate(opt.param_groups):
                program.hold(group["params"],
                             f"parameters in param group {g} of the {type(opt).__name__}")
            for p, per_param in opt.state.items():
                program.sized.append(per_param)
                program.size_names.append(f"state entries of a parameter in the "
                                          f"{type(opt).__name__}")
        program.sizes = [len(d) for d in program.sized]

    def _check_host_state(self, rates, groups, slots, host_values):
        name = self.compiled.name
        for rate in rates:
            if rate.changed():
                raise StateError(
                    f"xshard.compile({name}): the step changed the learning rate of param group "
                    f"{rate.group} (an LR scheduler stepped inside the compiled function?). Python "
                    f"in a compiled step runs only when it is recorded; call scheduler.step() "
                    f"outside it, between calls: the compiled step reads the learning rate on "
                    f"every call.")
        for opt, settings in groups:
            for g, (group, recorded) in enumerate(zip(opt.param_groups, settings)):
                for k, v in recorded.items():
                    if not isinstance(v, optim_support.RateRecord) and \
                            not same_value(group.get(k), v):
                        raise StateError(
                            f"xshard.compile({name}): the step changed optimizer "
                            f"param_groups[{g}][{k!r}] from {v!r} to {group.get(k)!r}; Python in "
                            f"a compiled step runs only when it is recorded. Change it between "
                            f"calls (the step is then recorded again).")
        for slot in slots:
            spec = host_values.get(slot.key)
            if spec is not None and spec != spec_of(slot.get()):
                if isinstance(slot, st.OptimizerStateSlot):
                    fix = ("Use an optimizer that keeps such state in tensors (for the Adam "
                           "family, capturable=True)")
                else:  # a counter of the user's or a library's (AveragedModel.n_averaged)
                    fix = ("Make that update outside the compiled step, between calls (e.g. "
                           "ema.update_parameters(model) after step(...)), or keep the value in "
                           "a device tensor that the step updates with tensor ops")
                raise StateError(
                    f"xshard.compile({name}): the step changed {slot.name}, a Python value "
                    f"({describe(spec)} -> {describe(spec_of(slot.get()))}), which a replay "
                    f"cannot update. {fix}, or run this step without xshard.compile.")

    def _build_in_rates(self, rates, groups) -> None:
        """Learning rates torch.optim read as numbers are constants of the program, kept by the
        guard (see [Note: optimizers in a compiled step])."""
        settings = dict((id(opt), s) for opt, s in groups)
        for rate in rates:
            if rate.read_at is None:
                continue
            settings[id(rate.optimizer)][rate.group]["lr"] = rate.recorded()
            if not self.compiled.warned_rate:
                self.compiled.warned_rate = True
                warnings.warn(
                    f"xshard.compile({self.compiled.name}): {type(rate.optimizer).__name__}.step "
                    f"reads the learning rate of param group {rate.group} as a Python number (at "
                    f"{rate.read_at}), so the compiled step holds its value and is recorded again "
                    f"whenever it changes (a scheduler).",
                    stacklevel=user_stacklevel())

    def _draws(self, stream) -> int:
        """How many random draws the step made (see [Note: random draws in a compiled step])."""
        seed, counter = rng.position()
        if seed != stream[0]:
            raise StateError(
                f"xshard.compile({self.compiled.name}): the step seeded the device random stream "
                f"(torch.manual_seed or set_rng_state inside the compiled function); Python in a "
                f"compiled step runs only when it is recorded, so a replay would not seed it. "
                f"Seed outside the step, before calling it.")
        return (counter - stream[1]) & rng.MASK  # the uint64 counter wraps

    def _undo(self, slots, entry, wrapped, rates, saved_state, groups):
        """After a failed recording: the state as it was at entry; half-done work never runs."""
        for rate in rates:
            rate.restore()
        for opt, settings in groups:
            for group, recorded in zip(opt.param_groups, settings):
                group.update((k, v) for k, v in recorded.items()
                             if not isinstance(v, optim_support.RateRecord))
        for opt, saved in saved_state:  # the same dicts, with the entries they had
            for p in list(opt.state):
                if p in saved:
                    opt.state[p].clear()
                    opt.state[p].update(saved[p])
                else:
                    del opt.state[p]
        for slot, obj in zip(slots, entry):
            if not isinstance(slot, (st.ArgSlot, st.GroupParamSlot)) and \
                    slot.get() is not obj:
                slot.set(obj)
        for storage, node, _ in wrapped.values():
            api.write_storage(storage, node)
        error = CompileError(f"this tensor was computed by a failed recording of xshard.compile("
                             f"{self.compiled.name}); compute it again outside the step.")
        for storage in api.pending_storages():
            api.quarantine(storage, error)

    # -- the program

    def _plan(self, program: Program, entry, exits, wrapped, rates, numbers, result_box,
              stream):
        """Builds and compiles the step's graph and fills in where the program reads its inputs
        and stores its outputs; returns the inputs of this call, and the graph."""
        name = self.compiled.name
        out = result_box.pop()
        slots = program.slots
        pairs = []  # (value node, annotation) per output
        replaced = {}  # pair index -> the entry data node its storage held
        writes = []
        destination = {}  # id(storage) -> pair index
        accounted = set()  # storages whose pending value is dealt with otherwise
        # id(storage) -> the first non-view slot holding it. A view of such a storage (in a slot,
        # or returned: ``model.weight.detach()``) shares it, as in eager: later steps update it,
        # and it never holds an array a later call consumes.
        exit_storage = {}
        for i, o in enumerate(exits):
            if api.is_device_tensor(o) and not api.is_view(o):
                exit_storage.setdefault(id(api.storage(o)), i)
        for i, obj in enumerate(exits):
            if obj is None:
                if entry[i] is not None:
                    program.clears.append(i)
                continue
            if not api.is_device_tensor(obj):
                continue
            if api.is_view(obj):
                storage = api.storage(obj)
                if id(storage) in exit_storage:
                    continue  # a view of state another slot holds: it follows that storage
                w = wrapped.get(id(storage))
                if w is not None and api.storage_value(storage) is w[2]:
                    continue  # untouched
                if isinstance(slots[i], st.HeldSlot) or slots[i].key[0] in (
                        "param", "group_param"):
                    raise StateError(
                        f"xshard.compile({name}): {slots[i].name} is a view of a storage no "
                        f"other state holds (torch.nn.utils.vector_to_parameters, or "
                        f"p.data = flat[a:b].view_as(p)), and the step writes it. A compiled "
                        f"step stores each parameter in its own storage, which would change "
                        f"the parameter object. Give each parameter its own storage first "
                        f"(p.data = p.data.clone()), or run this step without xshard.compile.")
                # stored as a base tensor holding the view's value
                accounted.add(id(storage))
                pairs.append((api.value(obj), None))
                writes.append(Write(i, len(pairs) - 1, obj.shape, obj.dtype, None))
                continue
            storage = api.storage(obj)
            value = api.storage_value(storage)
            w = wrapped.get(id(storage))
            if w is not None and value is w[2]:
                continue  # untouched
            if id(storage) not in destination:
                destination[id(storage)] = len(pairs)
                replaced[len(pairs)] = w[1] if w is not None else None
                pairs.append((value, api.annotation(obj)))
                writes.append(Write(i, len(pairs) - 1, value.shape, value.dtype,
                                    api.annotation(obj)))
        leaves_out, out_def = pytree.tree_flatten(out)
        exit_slot = {id(o): i for i, o in enumerate(exits) if api.is_device_tensor(o)}
        returns = self._returns(leaves_out, exit_slot, exit_storage, pairs, accounted)
        del out, leaves_out

        # Pending storages that no slot or result holds: values the step kept elsewhere (a list,
        # a module attribute that is not a buffer). A replay cannot update them, so they are left
        # out, and reading one says why.
        arguments = {id(storage) for _, _, storage in numbers.values()}  # the step's own
        stray = [s for s in api.pending_storages()
                 if id(s) not in destination and id(s) not in accounted and id(s) not in wrapped
                 and id(s) not in arguments]
        # State the step changed and then let go of (a gradient accumulated, then set to None by
        # zero_grad): no slot holds it any more, so it is left out as well, without a warning;
        # it reads the step's inputs, which the step may consume.
        dropped = [storage for k, (storage, _, wrapper) in wrapped.items()
                   if k not in destination and k not in accounted
                   and api.storage_value(storage) is not wrapper]
        for storages, error in (
                (dropped, f"this tensor was changed inside xshard.compile({name}) after the step "
                          f"had let go of it (a gradient set to None by zero_grad, a replaced "
                          f"buffer); a compiled step does not update it. Read it from the model or "
                          f"optimizer instead."),
                (stray, f"this tensor was computed inside xshard.compile({name}) and kept outside "
                        f"the step's model, optimizer and return value; a compiled step does not "
                        f"update it. Return it from the step instead.")):
            for s in storages:
                api.quarantine(s, StateError(error))
        if stray:
            shapes = ", ".join(str(list(api.storage_value(s).shape)) for s in stray[:4])
            warnings.warn(
                f"xshard.compile({name}): the step keeps {len(stray)} tensor(s) it computed "
                f"outside the model, optimizer and return value (shapes {shapes}): later calls do "
                f"not update them, and reading one raises. Return them from the step; or, if they "
                f"are state of a module or optimizer xshard.compile did not find, pass that with "
                f"state=.", stacklevel=user_stacklevel())

        # Outputs computing the same value are stored once (see [Note: values computed twice] in
        # xshard.core.graph): the slots they go to then hold one data node.
        pairs = list(zip(same_values([v for v, _ in pairs]), [a for _, a in pairs]))

        holding = {}  # id(entry node) -> the slots holding it (see [Note: slots sharing data])
        arg_storages = set()
        for i, obj in enumerate(entry):
            if api.is_device_tensor(obj):
                storage = api.storage(obj)
                w = wrapped.get(id(storage))
                if w is not None:
                    holding.setdefault(id(w[1]), []).append(i)
                if isinstance(slots[i], st.ArgSlot):
                    arg_storages.add(id(storage))
        self._note_parting(slots, holding, writes, pairs)
        # The entry data of the state the step overwrites is consumed (donated), unless a storage
        # the step leaves alone or some other live storage holds the same array, or the output
        # replacing it is also returned as a new tensor (the next call would consume that).
        held = _held_elsewhere(wrapped)
        returned = {(id(pairs[a][0]), pairs[a][1]) for k, a, _ in returns if k == "new"}
        keeping = {id(node) for k, (_, node, _) in wrapped.items()
                   if k not in destination or k in arg_storages
                   or (id(pairs[destination[k]][0]), pairs[destination[k]][1]) in returned}
        consumed = {id(node) for k, (_, node, _) in wrapped.items()
                    if id(node) not in keeping and id(node.payload) not in held}
        # The outputs replacing consumed state first, and those inputs in the same order (see
        # [Note: inputs in the order of the outputs that replace them] in xshard.core.graph),
        # each once.
        lead, leading = [], set()
        for p, (value, annotation) in enumerate(pairs):
            r = replaced.get(p)
            if r is not None and id(r) in consumed and id(r) not in leading and \
                    (id(value), annotation) not in leading:
                lead.append(p)
                leading.update((id(r), (id(value), annotation)))
        if lead:
            taken = set(lead)
            order = lead + [p for p in range(len(pairs)) if p not in taken]
            new = {old: p for p, old in enumerate(order)}
            pairs = [pairs[p] for p in order]
            for w in writes:
                w.position = new[w.position]
            returns = [(k, new[a], b) if k == "new" else (k, a, b) for k, a, b in returns]
        outputs, owners = execute.result_nodes(pairs)
        trace.end_recording()  # the recording is one TraceTime sample, as a lazy step's
        graph = Graph(outputs, first=[replaced[p] for p in lead])
        donate = tuple(k for k, n in enumerate(graph.inputs) if id(n) in consumed)
        with trace.naming(name):  # jit(xshard_<step function>_<n>), see xshard.core.trace
            exe = api.executable(graph, donate)
        program.executable, program.compiled = exe, exe.compiled
        # Multi-process runs check the program before each call (xshard.core.divergence); it reads
        # the graph. A digest exists exactly when processes compare them.
        program.graph = graph if exe.digest is not None else None
        values = compiler.input_values(graph)
        self._plan_inputs(program, graph, values, holding, rates, numbers, stream)
        mine = set(donate)
        # A cached executable compiled with other donations (the same graph, earlier): an input it
        # consumes that this step must keep is passed as a copy (as a lazy sync does).
        program.donated = [(p, program.inputs[p][1]) for p in exe.donate if p in mine]
        program.copied = [p for p in exe.donate if p not in mine]
        program.moves = [(p, program.inputs[p][1], program.inputs[p][0] == "arg", new)
                         for p, new in exe.moves if program.inputs[p][0] in ("arg", "state")]
        program.prepare()
        # See [Note: packed state] and [Note: numbers built into a replay] in packing.py.
        foldable = len(program.fixed_numbers) + len(program.random_inputs)
        if len(program.donated) + foldable >= packing.MIN_PACKED:
            program.plain = (compiler.Program(graph), compiler.compiler_options(graph))
        for w in writes:
            w.position = owners[w.position]
        program.writes = writes
        program.arg_writes = frozenset(w.slot for w in writes
                                       if isinstance(slots[w.slot], st.ArgSlot))
        program.returns = (out_def, [(k, owners[a], b) if k == "new" else (k, a, b)
                                     for k, a, b in returns])
        # What bounds the calls in flight: the tensors it returns (see [Note: a bounded dispatch
        # queue] in xshard.core.compiler), never state it donates.
        program.handles = compiler.small_results(
            [(a, b[:2]) for k, a, b in program.returns[1] if k == "new"])
        return values, graph

    def _returns(self, leaves, exit_slot, exit_storage, pairs, accounted) -> list:
        """Per leaf of the step's result, where a replay finds it: ``("slot", slot, None)``,
        ``("view", slot, view)`` of a slot's storage, ``("new", output, (shape, dtype, view))``,
        ``("same", earlier leaf, None)`` or ``("value", leaf, None)``. New results sharing a
        storage (``h, h[0]``, ``loss, loss.detach()``) are views of one output holding the
        storage's data, and a tensor returned twice is one object, as in eager. Appends the new
        outputs to ``pairs``."""
        distinct = {id(leaf): id(api.storage(leaf)) for leaf in leaves
                    if api.is_device_tensor(leaf)}
        returned_storages = Counter(distinct.values())
        shared_output = {}  # id(storage) -> output position of its data
        first = {}  # id(leaf) -> its place in the results
        returns = []
        for leaf in leaves:
            if id(leaf) in first:
                returns.append(("same", first[id(leaf)], None))
                continue
            if id(leaf) in distinct:
                first[id(leaf)] = len(returns)
            if id(leaf) in exit_slot:
                returns.append(("slot", exit_slot[id(leaf)], None))
            elif api.is_device_tensor(leaf) and id(api.storage(leaf)) in exit_storage:
                returns.append(("view", exit_storage[id(api.storage(leaf))], api.view_spec(leaf)))
            elif api.is_device_tensor(leaf):
                storage = api.storage(leaf)
                shared = returned_storages[id(storage)] > 1
                if id(storage) not in shared_output:
                    accounted.add(id(storage))
                    self.returned.append(weakref.ref(storage))
                    # Alone, just its value; shared, its storage's (each leaf a view of it)
                    pairs.append((api.storage_value(storage) if shared else api.value(leaf), None))
                    shared_output[id(storage)] = len(pairs) - 1
                node = pairs[shared_output[id(storage)]][0]
                returns.append(("new", shared_output[id(storage)],
                                (node.shape, node.dtype, api.view_spec(leaf) if shared else None)))
            else:
                self._refuse_hidden_tensors(leaf)
                returns.append(("value", leaf, None))
        return returns

    def _refuse_hidden_tensors(self, leaf) -> None:
        """A returned object that holds device tensors where pytree does not look (a dataclass or
        class not registered with it): a replay would return the recording's object, with the
        recording's tensors."""
        if not st.has_attributes(leaf) or isinstance(leaf, (torch.nn.Module, torch.optim.Optimizer)):
            return
        try:
            items = vars(leaf).items()
        except TypeError:
            return
        held = [k for k, v in items if any(map(api.is_device_tensor, pytree.tree_leaves(v)))]
        if held:
            raise CaptureError(
                f"xshard.compile({self.compiled.name}): the step returns a {type(leaf).__name__} "
                f"holding device tensors ({', '.join(held)}), which xshard.compile does not look "
                f"into: every call would return the first call's object. Return tensors in "
                f"tuples, lists, dicts or namedtuples, or register the class with "
                f"torch.utils._pytree (register_dataclass, register_pytree_node).")

    def _first_run(self, program: Program, planned, exits, wrapped):
        """Runs the program for the recording call and stores its results."""
        values, graph = planned
        del planned
        slots = program.slots
        results = program.execute(values, graph, None)
        del values, graph
        program.placement = [p for p, r in enumerate(results) if api.placed(r) is not r]
        for storage, node, wrapper in wrapped.values():
            if api.storage_value(storage) is wrapper:  # untouched: its own data back
                api.write_storage(storage, node)
        n = len(slots)
        program.expect, program.storage = [None] * n, [None] * n
        program.source, program.expect_version = [None] * n, [None] * n
        for kind, i, _ in program.inputs:
            if kind == "state":
                program.expect_version[i] = -1  # an input: adopt() fills in the version
        for i, obj in enumerate(exits):
            if not isinstance(slots[i], st.ArgSlot):
                program.adopt(i, obj)
        result = program.store(results)
        del results
        return result

    def _note_parting(self, slots, holding, writes, pairs) -> None:
        """Slots read as one input that this step leaves holding different values: the next
        call records the step again, and that recording reads them apart (see
        ``_share_equal_scalars``)."""
        after = {w.slot: (id(pairs[w.position][0]), pairs[w.position][1]) for w in writes}
        for held in holding.values():
            if len(held) > 1 and len({after.get(i) for i in held}) > 1:
                self.compiled.unjoined.update(slots[i].key for i in held)

    def _plan_inputs(self, program, graph, values, holding, rates, numbers, stream):
        """Where each executable input comes from on a replay."""
        shardings = _placed_inputs(program.compiled.input_shardings[0])
        rate_of = {id(r.input): r for r in rates}
        draws = _random_inputs(graph, stream, self.compiled.name)
        inputs = []
        for k, node in enumerate(graph.inputs):
            if id(node) in holding:
                i, *others = holding[id(node)]
                kind = "arg" if isinstance(program.slots[i], st.ArgSlot) else "state"
                inputs.append((kind, i, None))
                if others:
                    program.shared.append((i, others))
            elif id(node) in rate_of:
                r = rate_of[id(node)]
                inputs.append(("lr", Rate(r.optimizer, r.group, to_numpy_dtype(r.dtype),
                                          shardings[k]), None))
            elif id(node) in numbers:
                i, dtype, _ = numbers[id(node)]
                inputs.append(("number", i, dtype))
            elif id(node) in draws:
                # The stream's seed (offset None) or a draw's counter (its offset from the start).
                inputs.append(("random", draws[id(node)], to_numpy_dtype(node.dtype)))
            else:
                # A constant, placed once: a host value would be copied on every call.
                value = values[k]
                number = node.payload if node.op is ir.SCALAR else None
                if not isinstance(value, runtime.jax_module().Array):
                    value = arrays.put(np.asarray(value), shardings[k], "a compiled step's "
                                       "constant")
                inputs.append(("constant", value, number))
        program.inputs = inputs
        _guard_constants(program, graph)


def _arg_grad_slots(arg_slots, leaves, state_slots) -> list:
    """``.grad`` of each floating-point tensor argument (``backward()`` fills it when the argument
    requires grad, or the step makes it), but of one the state holds as a parameter (``step(w)``
    for ``model.w``), whose gradient slot the state has."""
    params = {s.key[1] for s in state_slots if s.key[0] == "grad"}
    return [st.ArgGradSlot(s) for s in arg_slots
            if (leaves[s.index].is_floating_point() or leaves[s.index].is_complex())
            and id(leaves[s.index]) not in params]


def _placed_inputs(shardings) -> list:
    """Each input's sharding, replicated over the program's devices where jit left one unplaced
    (a host scalar): the step places such a constant once, which takes a global layout when the
    devices span processes."""
    shardings = list(shardings)
    some = next((s for s in shardings if s is not None), None)
    if some is None or all(s is not None for s in shardings):
        return shardings
    jax = runtime.jax_module()
    mesh = jax.sharding.Mesh(np.array(some._device_assignment, dtype=object), ("devices",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return [replicated if s is None else s for s in shardings]


def _guard_constants(program: Program, graph) -> None:
    """The storages that hold device data the program has built in (a tensor in a list, an
    optimizer's device-tensor learning rate): each call checks that none was written since."""
    built_in = {id(node) for (kind, _, _), node in zip(program.inputs, graph.inputs)
                if kind == "constant" and node.op is ir.DATA}
    if not built_in:
        return
    for storage in api.live_storages():
        node = api.storage_value(storage)
        if id(node) in built_in:
            program.constant_storages.append(
                (weakref.ref(storage), api.storage_version(storage), tuple(node.shape)))


def _random_inputs(graph, stream, name: str) -> dict:
    """id(scalar input) -> None for the random stream's seed, or k for the counter of a draw made
    k draws after the step began (see [Note: random draws in a compiled step])."""
    seed, start = stream
    found = {}
    for node in graph.order:
        if node.op is not ir.RNG_KEY:
            continue
        seed_node, counter_node = node.inputs
        if seed_node.payload != seed:
            raise StateError(
                f"xshard.compile({name}): a random op inside the step draws from another seed "
                f"than the stream's ({seed_node.payload} instead of {seed}): the step seeds the "
                f"stream (torch.manual_seed or set_rng_state inside the compiled function). Seed "
                f"outside the step, before calling it.")
        found[id(seed_node)] = None
        found[id(counter_node)] = counter_node.payload - start
    return found


def _held_elsewhere(wrapped) -> set:
    """Ids of arrays a live storage other than the wrapped ones holds (never donated)."""
    held = set()
    for storage in api.live_storages():
        if id(storage) in wrapped:
            continue
        node = api.storage_value(storage)
        if node.op is ir.DATA:
            held.update(map(id, ir.arrays_of(node)))
    return held


# The dicts of a module whose sizes are part of the form of the state a step was recorded for, and
# those whose entries must be the same objects.
_MODULE_DICTS = ("_parameters", "_buffers")
_MODULE_HELD = ("_modules", "_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                "_backward_hooks")
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                 "_global_backward_pre_hooks", "_global_backward_hooks")

# What every nn.Module has in its __dict__ (parameters, buffers, hooks, ``training``): not settings.
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)


def _settings(modules, roots) -> list:
    """(container, key, name) of each Python setting a step may read: the modules' and the
    optimizers' attributes that are settings, and those the step function reads from its closure
    and globals (``container.get(key, None)`` reads each)."""
    out = []
    for m in modules:
        for k, v in m.__dict__.items():
            if k not in _MODULE_INTERNALS and (v is None or st.is_setting(v)):
                out.append((m.__dict__, k, f"{type(m).__name__}.{k}"))
    for opt in roots.optimizers:  # an optimizer's own attributes (``self.scale``)
        for k, v in vars(opt).items():
            if not k.startswith("_") and k not in _OPTIMIZER_INTERNALS and st.is_setting(v):
                out.append((vars(opt), k, f"{type(opt).__name__}.{k}"))
    return out + list(roots.settings) + list(roots.contents)


_OPTIMIZER_INTERNALS = frozenset({"defaults", "state", "param_groups"})


def _put_back(settings, before) -> None:
    """Puts back the Python settings a refused recording changed (a counter the step counts)."""
    for (container, key, _), was in zip(settings, before):
        now = container.get(key, None)
        if was is None or now is was or same_value(now, was):
            continue  # (None: it may not have existed)
        if isinstance(container, dict):
            container[key] = was
        elif hasattr(container, "put"):
            container.put(key, was)


def _record_settings(program: Program, roots, settings, before) -> None:
    """The Python settings the program has built in: the modules' (``self.scale = 0.5``,
    ``dropout.p``, ``eps``), the optimizers', and those the step function reads from its
    closure and globals, as they were when the step began (``before``, per entry of
    ``settings``). The guard compares them on every call; one the step changes (a counter,
    ``self.steps += 1``) is set to the value the step left by each replay, so a step that keeps
    changing it records again each call, and runs its Python. One the step changes from None (a
    lazy initialisation) is compared as the step left it. The other objects the step reached
    that way are compared by identity (see [Note: what the step reaches])."""
    for m in program.flag_modules:
        d = m.__dict__
        # An attribute added since (``m.forward = ...``); counted as the step left them (a forward
        # may add a cache attribute the first time it runs).
        program.sized.append(d)
        program.sizes.append(len(d))
        program.size_names.append(f"attributes of the {type(m).__name__}")
        for k, v in d.items():
            if k not in _MODULE_INTERNALS and not isinstance(v, torch.Tensor) and \
                    not (v is None or st.is_setting(v)):
                program.bind(d, k, f"{type(m).__name__}.{k}")
    for (container, key, name), v in zip(settings, before):
        after = container.get(key, None)
        if v is None:  # a lazy initialisation (FSDP's, a cache): compared as the step left it
            v = after
        if isinstance(container, st.Contents) and not same_value(after, v):
            # A list or dict the step fills (``calls.append(1)``, tensors it keeps): its Python
            # runs only while it is recorded, as in jax.jit (kept tensors are reported below).
            continue
        program.settings.append((container, key))
        program.setting_values.append(v)
        program.setting_names.append(name)
        if not same_value(after, v):
            if not isinstance(container, dict):
                raise StateError(
                    f"xshard.compile({program.name}): the step changes {name} ({v!r} -> "
                    f"{after!r}), a Python value a replay cannot set. Keep it as a tensor, or "
                    f"change it outside the step.")
            program.settings_after.append((container, key, after))
    seen = {(id(container), key) for container, key, _ in settings}
    for container, key, name in _settings(program.flag_modules, roots):
        if (id(container), key) not in seen:  # added by the step: compared as it left it
            program.settings.append((container, key))
            program.setting_values.append(container.get(key, None))
            program.setting_names.append(name)
    program.setting_types = [type(v) for v in program.setting_values]
    for container, key, name in roots.bindings:
        program.bind(container, key, name)


# [Note: what the step reaches]
# A replay runs none of the step's Python, so it runs with the objects the recording found: the
# model its closure or a global named, the trainer attribute ``self.model``, a submodule
# (``model[1]``), a module's ``self.act = torch.relu``, the parameter objects the optimizer holds,
# each hook. Each such reference is compared by identity on every call (a list of ``is`` checks):
# ``model = Net()`` after the step was compiled, ``model[1] = nn.Tanh()``, a new ``nn.Parameter``
# in place of one, a hook replaced, each records the step again. What the objects hold is
# compared only where it is state (tensors, by slot, device tensors in a dict, list or tuple
# included) or a setting (by value); a change inside another object (a helper's attribute) is not
# seen: pass such values as arguments.
