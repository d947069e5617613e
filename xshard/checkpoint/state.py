"""Modules and optimizers inside a checkpoint's state: their device state, read and written in place.

``xshard.checkpoint.save`` / ``load`` accept ``nn.Module`` and ``torch.optim.Optimizer`` objects
anywhere in the nested state dict. A module contributes ``nn.Module.state_dict(module)``: its
parameters and buffers as they live on the devices, under the plain model's names. For an FSDP
model this skips ``FSDP.state_dict``, which gathers full CPU copies, so each process writes only
its own shards. Loading writes into those same tensors, so the module needs no
``load_state_dict``. An optimizer contributes ``optimizer.state_dict()``; loading first creates
its state if it has none yet (``prime_optimizer``), then hands the loaded dict to
``optimizer.load_state_dict`` for the hyperparameters.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def prime_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Creates an optimizer's per-parameter state (e.g. AdamW's moments) without changing anything.

    An optimizer has no state before its first step, so ``optimizer.state_dict()`` has nothing to
    load a checkpoint into. This takes one step with zero gradients and a learning rate of 0, which
    leaves every parameter exactly as it was, then restores the gradients and learning rates. The
    state's values (and AdamW's step count) are then whatever a load writes over them. Optimizers
    that already hold state for every trainable parameter are left alone.

    Args:
        optimizer: any ``torch.optim`` optimizer.

    Returns:
        ``optimizer``.

    Example:
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> state = {"optim": xcp.prime_optimizer(opt).state_dict()}
        >>> dcp.load(state, checkpoint_id=path, planner=xcp.LoadPlanner())  # doctest: +SKIP
        >>> opt.load_state_dict(state["optim"])  # doctest: +SKIP
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"prime_optimizer needs a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}.")
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if all(optimizer.state.get(p) for p in params):
        return optimizer
    grads = [p.grad for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for p, g in zip(params, grads):
            p.grad = g
    return optimizer


def to_state_dicts(state, *, prime: bool) -> dict:
    """A copy of nested dict ``state`` with each module and optimizer replaced by its state dict."""
    if not isinstance(state, dict):
        raise TypeError(
            f"A checkpoint's state must be a dict (e.g. {{'model': model, 'optim': opt, "
            f"'step': step}}), got {type(state).__name__}.")
    out = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            out[key] = nn.Module.state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            out[key] = (prime_optimizer(value) if prime else value).state_dict()
        elif isinstance(value, dict):
            out[key] = to_state_dicts(value, prime=prime)
        else:
            out[key] = value
    return out


def drop_unsaved_state(state: dict, targets: dict, saved_keys) -> None:
    """Leaves out of ``targets`` (``to_state_dicts(state)``) the per-parameter optimizer state a
    checkpoint does not hold (``saved_keys``: its flattened keys): a parameter that had no gradient
    yet when it was saved. The load then leaves it without state, as ``opt.load_state_dict``
    does, where priming had created some."""
    saved = {key.rsplit(".", 1)[0] for key in saved_keys}  # "optim.state.2.step" -> "optim.state.2"

    def drop(state, targets, prefix):
        for key, value in state.items():
            if isinstance(value, torch.optim.Optimizer):
                per_param = targets[key]["state"]
                for pid in [pid for pid in per_param if f"{prefix}{key}.state.{pid}" not in saved]:
                    del per_param[pid]
            elif isinstance(value, dict):
                drop(value, targets[key], f"{prefix}{key}.")

    drop(state, targets, "")


def write_back(state: dict, loaded: dict) -> None:
    """Puts what a load produced (``loaded``, shaped by ``to_state_dicts``) into ``state``: Python
    values into its dicts, optimizer state into the optimizers (tensors were written in place)."""
    for key, value in state.items():
        new = loaded[key]
        if isinstance(value, nn.Module):
            # Tensors were loaded in place; only a module with non-tensor state (get_extra_state)
            # needs its load_state_dict.
            if any(not isinstance(v, torch.Tensor) for v in new.values()):
                nn.Module.load_state_dict(value, new)
        elif isinstance(value, torch.optim.Optimizer):
            value.load_state_dict(new)
        elif isinstance(value, dict):
            write_back(value, new)
        else:
            state[key] = new
