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
  for-loop form); both hold while the optimizer's ``step`` is recorded.

Every other hyper-parameter (momentum, betas, weight decay, ...) shapes the program; it is part of
the compiled step's guard, and changing one records the step again.
"""

from __future__ import annotations

import contextlib

import torch

from xshard.core import api


def make_capturable(optimizers) -> None:
    """Turns on ``capturable`` where an optimizer has it and puts step counts on the device."""
    for opt in optimizers:
        if "capturable" not in opt.defaults:
            continue
        opt.defaults["capturable"] = True
        for group in opt.param_groups:
            if group.get("capturable") is False:
                group["capturable"] = True
            for p in group["params"]:
                state = opt.state.get(p)
                step = None if state is None else state.get("step")
                if isinstance(step, torch.Tensor) and not api.is_device_tensor(step) and \
                        api.is_device_tensor(p):
                    state["step"] = step.to(p.device)


class LiftedRate:
    """One group's learning rate, a 0-d device tensor while the step is recorded."""

    __slots__ = ("optimizer", "group", "original", "tensor", "dtype", "node", "input")

    def __init__(self, optimizer, group: int):
        self.optimizer, self.group = optimizer, group
        self.original = optimizer.param_groups[group]["lr"]
        self.dtype = torch.get_default_dtype()
        value = torch.tensor(host_rate(self.original), dtype=self.dtype)
        leaf = api.new_tensor(api.upload(value), requires_grad=True)
        self.input = api.value(leaf)  # the data node the program reads
        # Requiring grad steers SGD's for-loop form to its tensor-rate path; not being a leaf lets
        # a scheduler stepped inside the function write it in place (and be caught doing so).
        self.tensor = leaf.clone()
        self.node = api.value(self.tensor)

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
    return type(lr) in (float, int) or (isinstance(lr, torch.Tensor) and lr.device.type == "cpu"
                                        and lr.numel() == 1)


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
    """While each optimizer's ``step`` runs, torch.optim takes its graph-capture code paths."""
    import torch.compiler as compiler

    saved = compiler._is_compiling_flag

    def pre(opt, args, kwargs):
        compiler._is_compiling_flag = True

    def post(opt, args, kwargs):
        compiler._is_compiling_flag = saved

    handles = []
    for opt in optimizers:
        handles.append(opt.register_step_pre_hook(pre))
        handles.append(opt.register_step_post_hook(post))
    try:
        yield
    finally:
        compiler._is_compiling_flag = saved
        for h in handles:
            h.remove()


def hyperparameters(opt) -> list[dict]:
    """Each group's settings other than its parameters and learning rate (the guard's part)."""
    return [{k: v for k, v in group.items() if k not in ("params", "lr")}
            for group in opt.param_groups]
