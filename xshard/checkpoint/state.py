"""Modules, optimizers and other stateful objects inside a checkpoint's state: their device state,
read and written in place.

``xshard.checkpoint.save`` / ``load`` accept ``nn.Module`` and ``torch.optim.Optimizer`` objects
anywhere in the nested state dict. A module contributes ``nn.Module.state_dict(module)``: its
parameters and buffers as they live on the devices, under the plain model's names. For an FSDP
model this skips ``FSDP.state_dict``, which gathers full CPU copies, so each process writes only
its own shards. Loading writes into those same tensors, so the module needs no
``load_state_dict``. An optimizer contributes ``optimizer.state_dict()``; loading first creates
its state if it has none yet (``prime_optimizer``), then hands the loaded dict to
``optimizer.load_state_dict`` for the hyperparameters. Any other object with ``state_dict`` and
``load_state_dict`` (DCP's ``Stateful``: an LR scheduler, a GradScaler, a stateful data loader),
at any depth, contributes its ``state_dict()`` and gets ``load_state_dict`` with what was loaded.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful


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
        if _needs_closure(optimizer):  # LBFGS: its step evaluates the loss
            optimizer.step(lambda: torch.zeros(()))
        else:
            optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for p, g in zip(params, grads):
            p.grad = g
    return optimizer


def _needs_closure(optimizer) -> bool:
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def to_state_dicts(state, *, prime: bool) -> dict:
    """A copy of nested dict ``state`` with each module, optimizer and other ``Stateful`` object
    replaced by its state dict (DCP would convert top-level ones itself, but on load calls their
    ``load_state_dict`` before a deferred load has written anything, and it pickles nested ones
    whole)."""
    if not isinstance(state, dict):
        raise TypeError(
            f"A checkpoint's state must be a dict (e.g. {{'model': model, 'optim': opt, "
            f"'step': step}}), got {type(state).__name__}.")
    out = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            out[key] = nn.Module.state_dict(value)
            for name, buffer, dtype in _cast_buffers(value):
                if name in out[key]:
                    out[key][name] = buffer.detach().to(dtype)
        elif isinstance(value, torch.optim.Optimizer):
            out[key] = (prime_optimizer(value) if prime else value).state_dict()
        elif isinstance(value, dict):
            out[key] = to_state_dicts(value, prime=prime)
        elif _stateful(value):
            out[key] = value.state_dict()
        else:
            out[key] = value
    return out


def _cast_buffers(module: nn.Module) -> list:
    """``(state dict key, buffer, dtype)`` of each buffer FSDP's ``MixedPrecision(buffer_dtype=)``
    keeps in another dtype than it had: a checkpoint holds it in the dtype it had (as
    ``FSDP.state_dict`` and PyTorch's FSDP do), so it loads under any mixed-precision setting."""
    out = []
    for prefix, m in module.named_modules():
        dtypes = getattr(m, "_fsdp_buffer_dtypes", None)
        if dtypes:
            own = dict(m.named_buffers())
            out += [(f"{prefix}.{name}" if prefix else name, own[name], dtype)
                    for name, dtype in dtypes.items() if name in own]
    return out


def _stateful(value) -> bool:
    return isinstance(value, Stateful) and not isinstance(value, (torch.Tensor, type))


def match_saved_state(state: dict, targets: dict, metadata) -> None:
    """Makes each optimizer's per-parameter state in ``targets`` (``to_state_dicts(state)``) hold
    what the checkpoint (``metadata``, DCP's) holds for it:

    - state a parameter has after priming but not in the checkpoint (it had no gradient yet when
      saved) is left out, so the load leaves it without state, as ``opt.load_state_dict`` does;
    - entries the checkpoint holds for a parameter that priming does not create (LBFGS's search
      direction and history, made by later steps) are added, as host tensors of the saved shape
      and dtype or Python values, for ``optimizer.load_state_dict`` to place as it does a
      ``torch.load``-ed state dict. Parameters the optimizer does not have get nothing: their
      entries stay extra, and ``check_state`` refuses the checkpoint before anything is read."""
    saved = metadata.state_dict_metadata
    paths = metadata.planner_data or {}
    # Every prefix of a saved key: "optim.state.2.mom.buf" holds "optim.state.2" (a parameter's
    # state may nest dicts and lists).
    prefixes = {key[:i] for key in saved for i, c in enumerate(key) if c == "."}

    def match(state, targets, prefix, path):
        for key, value in state.items():
            if isinstance(value, torch.optim.Optimizer):
                per_param = targets[key]["state"]
                for pid in [p for p in per_param if f"{prefix}{key}.state.{p}" not in prefixes]:
                    del per_param[pid]
                under = (*path, str(key), "state")
                ids = {str(pid): pid for pid in per_param}
                for fqn in sorted(fqn for fqn, p in paths.items()
                                  if p[:len(under)] == under and len(p) > len(under) + 1
                                  and str(p[len(under)]) in ids):
                    rest = paths[fqn][len(under):]
                    _add_missing(per_param[ids[str(rest[0])]], rest[1:], saved[fqn])
            elif isinstance(value, dict):
                match(value, targets[key], f"{prefix}{key}.", (*path, str(key)))

    match(state, targets, "", ())


def _add_missing(container, path: tuple, md) -> None:
    """Puts a placeholder for a saved entry (``md``) at ``path`` inside ``container`` (one
    parameter's state) unless something is there already (dicts and lists on the way are
    created)."""
    for i, step in enumerate(path):
        last = i == len(path) - 1
        if isinstance(container, dict):
            key = next((k for k in container if str(k) == str(step)), None)
            if key is None:
                key = step
                container[key] = _placeholder(md) if last else \
                    ([] if isinstance(path[i + 1], int) else {})
            container = container[key]
        elif isinstance(container, list) and isinstance(step, int):
            while len(container) <= step:
                container.append(None)
            if container[step] is None:
                container[step] = _placeholder(md) if last else \
                    ([] if isinstance(path[i + 1], int) else {})
            container = container[step]
        else:
            return  # the state holds a value where the checkpoint has a container: check_state says


def _placeholder(md):
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(tuple(md.size), dtype=md.properties.dtype)
    return None  # a Python value, read as it was saved


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
            with torch.no_grad():  # loaded into copies in the dtype they had: cast back
                for name, buffer, _ in _cast_buffers(value):
                    if name in new:
                        buffer.copy_(new[name])
        elif isinstance(value, torch.optim.Optimizer):
            value.load_state_dict(new)
        elif isinstance(value, dict):
            write_back(value, new)
        elif _stateful(value):
            value.load_state_dict(new)
        else:
            state[key] = new
