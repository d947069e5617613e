"""Auto-wrap policies: which submodules become FSDP units. The policies are PyTorch's own
(``torch.distributed.fsdp.wrap``); ``select_units`` applies one.

A policy is called as ``policy(module=m, recurse=..., nonwrapped_numel=n)``, the signature PyTorch FSDP
users write with ``functools.partial`` (a ``ModuleWrapPolicy`` is called the same way). With ``recurse=True`` it answers "may units be made inside
``m``?"; with ``recurse=False``, "is ``m`` itself a unit?", ``n`` being the parameters of ``m`` not
already in a unit below it.

Example:
    >>> policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    >>> policy = functools.partial(size_based_auto_wrap_policy, min_num_params=int(1e7))
"""

from __future__ import annotations

import inspect
from typing import Iterable

import torch.nn as nn
from torch.distributed.fsdp import wrap as _torch_wrap
from torch.distributed.fsdp.wrap import (ModuleWrapPolicy, always_wrap_policy,  # noqa: F401
                                         lambda_auto_wrap_policy, size_based_auto_wrap_policy)

__all__ = ["always_wrap_policy", "lambda_auto_wrap_policy", "transformer_auto_wrap_policy",
           "size_based_auto_wrap_policy", "ModuleWrapPolicy", "select_units"]


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type]) -> bool:
    """PyTorch's policy (a unit for each instance of the given layer classes, e.g. a transformer
    block), also taking one class where PyTorch wants a set, and checking the classes."""
    return _torch_wrap.transformer_auto_wrap_policy(
        module, recurse, nonwrapped_numel, _layer_classes(transformer_layer_cls))


def _layer_classes(transformer_layer_cls) -> set:
    classes = ((transformer_layer_cls,) if isinstance(transformer_layer_cls, type)
               else tuple(transformer_layer_cls))
    for c in classes:
        if not isinstance(c, type):
            raise TypeError(
                f"transformer_layer_cls must hold module classes, got {c!r} in "
                f"{transformer_layer_cls!r}; pass e.g. transformer_layer_cls={{Block}}.")
    return set(classes)


def _numel(module: nn.Module, seen: set) -> int:
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            total += p.numel()
    return total


def _check_policy(policy) -> None:
    if policy is None:
        return
    if not callable(policy):
        raise TypeError(
            f"auto_wrap_policy must be a callable or None, got {policy!r}; pass e.g. "
            f"functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={{Block}}) or "
            f"functools.partial(size_based_auto_wrap_policy, min_num_params=int(1e7)).")
    try:
        inspect.signature(policy).bind(module=None, recurse=True, nonwrapped_numel=0)
    except (TypeError, ValueError) as e:  # ValueError: a partial binding an unknown argument
        raise TypeError(
            f"auto_wrap_policy {policy!r} cannot be called as policy(module=..., recurse=..., "
            f"nonwrapped_numel=...) ({e}); write it with that signature, or bind its own "
            f"arguments with functools.partial.") from None


def select_units(root: nn.Module, policy) -> list[nn.Module]:
    """The modules that become units, innermost first; the root is always the last one."""
    _check_policy(policy)
    units: list[nn.Module] = []
    claimed: set = set()  # ids of parameters owned by a unit already

    def visit(module: nn.Module) -> None:
        if policy is None:
            return
        if not policy(module=module, recurse=True, nonwrapped_numel=_numel(module, claimed)):
            return
        for child in module.children():
            visit(child)
        if module is not root and policy(module=module, recurse=False,
                                         nonwrapped_numel=_numel(module, claimed)):
            units.append(module)
            claimed.update(id(p) for p in module.parameters())

    visit(root)
    units.append(root)
    return units
