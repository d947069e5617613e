"""What ``torch.optim`` needs so that one recorded step serves every later one.

[Note: optimizers in a compiled step]
A replay runs no Python, so nothing an optimizer computes on the host may end up in the program
as a constant:

- the Adam family counts steps in ``state['step']``, a CPU tensor read with ``.item()`` unless the
  optimizer is *capturable*: then the count is a device tensor and the bias corrections are computed
  on the device. ``xshard.compile`` turns ``capturable`` on (for good: the lazy path runs such an
  optimizer just as well) and moves existing step counts to the device;
- the learning rate is read from ``param_groups`` by every step, and schedulers change it between
  steps: while the step is recorded, each group's ``lr`` is a 0-d device tensor (torch.optim accepts
  a tensor ``lr``), so the program takes it as an input, read afresh from the group on every call;
- torch.optim picks code paths that keep a tensor ``lr`` on the device when
  ``torch.compiler.is_compiling()`` is true (SGD's foreach form) or the tensor requires grad (SGD's
  for-loop form); both hold while the optimizer's ``step`` is recorded;
- some code paths read the rate as a Python number all the same (Rprop's first step, the for-loop
  forms of RMSprop and Adadelta: ``value=-lr``). Such a read is let through when the value read
  depends on learning rates alone: the rate is then built into the program as a constant, the guard
  keeps its value, and a scheduler's change records the step again (a warning says so once).

Every other hyper-parameter (momentum, betas, weight decay, ...) shapes the program; it is part of
the compiled step's guard, and changing one records the step again. So is a learning rate that
cannot be lifted (a device tensor: its data is then a constant the program reads).
"""

from __future__ import annotations

import contextlib
import numbers
import weakref

import torch

from xshard.core import api, ir


def make_capturable(optimizers) -> None:
    """Turns on ``capturable`` where an optimizer has it and puts step counts on the device; its
    ``state_dict()`` still says what the user chose (see ``_saved_as_chosen``)."""
    for opt in optimizers:
        if "capturable" not in opt.defaults:
            continue
        opt.defaults["capturable"] = True
        for group in opt.param_groups:
            if group.get("capturable") is False:
                group["capturable"] = True
                if opt not in _SWITCHED:
                    _SWITCHED[opt] = set()
                    opt.register_state_dict_post_hook(_saved_as_chosen)
                _SWITCHED[opt].add(id(group))
            for p in group["params"]:
                state = opt.state.get(p)
                step = None if state is None else state.get("step")
                if isinstance(step, torch.Tensor) and not api.is_device_tensor(step) and \
                        api.is_device_tensor(p):
                    state["step"] = step.to(p.device)


# Per optimizer, the param groups (by id) ``make_capturable`` switched to capturable.
_SWITCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _saved_as_chosen(optimizer, state_dict):
    """``Optimizer.state_dict`` post hook: the groups xshard.compile switched to capturable are
    saved as the user made them, ``capturable=False`` with host step counts, as eager saves them
    (a CPU optimizer refused the checkpoint: "If capturable=True, params and state_steps must be
    on supported devices"). Loaded back into a compiled step's optimizer, they are switched again
    at its next recording."""
    switched = _SWITCHED.get(optimizer, ())
    for group, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
        if id(group) not in switched or group.get("fused"):
            continue
        saved["capturable"] = False
        for index in saved["params"]:
            entry = state_dict["state"].get(index, {})  # the optimizer's own dict: replaced
            if api.is_device_tensor(entry.get("step")):
                state_dict["state"][index] = {**entry, "step": entry["step"].detach().cpu()}
    return state_dict


class LiftedRate:
    """One group's learning rate, a 0-d device tensor while the step is recorded."""

    __slots__ = ("optimizer", "group", "original", "tensor", "dtype", "node", "input", "read_at")

    def __init__(self, optimizer, group: int):
        self.optimizer, self.group = optimizer, group
        self.original = optimizer.param_groups[group]["lr"]
        # A number, as torch.optim's own rates are: float64, promoting as a Python float (see
        # [Note: numbers in a graph] in xshard.core.record): a float64 model steps by the rate
        # itself, not by its float32 rounding.
        self.dtype = torch.float64
        self.input = api.upload(torch.tensor(host_rate(self.original), dtype=self.dtype))
        # Requiring grad steers SGD's for-loop form to its tensor-rate path (no other optimizer
        # looks; Rprop passes the rate where PyTorch takes a number, which refuses one that
        # requires grad). Not being a leaf lets a scheduler stepped inside the function write it
        # in place (and be caught doing so).
        leaf = api.new_tensor(ir.weak(self.input),
                              requires_grad=isinstance(optimizer, torch.optim.SGD))
        self.tensor = leaf.clone()
        self.node = api.value(self.tensor)
        self.read_at = None  # the line where torch.optim read it as a Python number

    def recorded(self):
        """What the guard keeps of this rate after the recording."""
        return LIFTED if self.read_at is None else BuiltIn(host_rate(self.original))

    def changed(self) -> bool:
        """Whether the step replaced or overwrote this learning rate."""
        current = self.optimizer.param_groups[self.group]["lr"]
        return self.tensor is None or current is not self.tensor or \
            api.value(self.tensor) is not self.node

    def restore(self) -> None:
        self.optimizer.param_groups[self.group]["lr"] = self.original
        self.tensor = None  # the program reads ``input``; nothing keeps this pending value


def host_rate(lr) -> float:
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


def liftable(lr) -> bool:
    """A learning rate the program can take as an input: a real number (NumPy's too) or a
    one-element CPU tensor."""
    if isinstance(lr, torch.Tensor):
        return lr.device.type == "cpu" and lr.numel() == 1 and not lr.is_complex()
    return isinstance(lr, numbers.Real)


class RateRecord:
    """The guard's record of a learning rate that was lifted (``matches``: whether a rate passes)."""

    def matches(self, lr) -> bool:
        return liftable(lr)

    def __repr__(self):
        return "a number (read on every call)"


LIFTED = RateRecord()  # the program reads the rate on every call: any liftable rate passes


class BuiltIn(RateRecord):
    """A lifted rate torch.optim read as a Python number while the step was recorded: the program
    holds this value."""

    __slots__ = ("value",)

    def __init__(self, value: float):
        self.value = value

    def matches(self, lr) -> bool:
        return liftable(lr) and host_rate(lr) == self.value

    def __repr__(self):
        return repr(self.value)


def rates_read(tensor, rates) -> list[LiftedRate]:
    """The rates that ``tensor``'s value is computed from, when it is computed from learning rates
    and numbers alone (else empty): reading it needs nothing the program has yet."""
    inputs = {id(r.input): r for r in rates}
    found, seen, stack = {}, set(), [api.value(tensor)]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        rate = inputs.get(id(node))
        if rate is not None:
            found[id(rate)] = rate
        elif node.op is ir.DATA or (node.op in ir.XSHARD_OPS and node.op is not ir.WEAK):
            return []  # state, arguments, constants, random numbers
        else:
            stack.extend(node.inputs)
    return list(found.values())


def lift_rates(optimizers) -> list[LiftedRate]:
    lifted = []
    for opt in optimizers:
        for g, group in enumerate(opt.param_groups):
            if liftable(group.get("lr")):
                rate = LiftedRate(opt, g)
                group["lr"] = rate.tensor
                lifted.append(rate)
    return lifted


@contextlib.contextmanager
def graph_paths(optimizers):
    """While each optimizer's ``step`` runs, torch.optim takes its graph-capture code paths.
    Yields a list holding the optimizer whose ``step`` runs, if one does."""
    import torch.compiler as compiler

    saved = compiler._is_compiling_flag
    stepping = []

    def pre(opt, args, kwargs):
        compiler._is_compiling_flag = True
        stepping.append(opt)

    def post(opt, args, kwargs):
        compiler._is_compiling_flag = saved
        stepping.clear()

    handles = []
    for opt in optimizers:
        handles.append(opt.register_step_pre_hook(pre))
        handles.append(opt.register_step_post_hook(post))
    try:
        yield stepping
    finally:
        compiler._is_compiling_flag = saved
        for h in handles:
            h.remove()


def hyperparameters(opt) -> list[dict]:
    """Each group's settings other than its parameters (the guard's part); a learning rate lifted
    to an input is recorded as ``LIFTED``."""
    return [{k: LIFTED if k == "lr" and liftable(v) else v for k, v in group.items()
             if k != "params"} for group in opt.param_groups]
