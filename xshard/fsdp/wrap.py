"""Auto-wrap policies: which submodules become FSDP units.

A policy is called as ``policy(module=m, recurse=..., nonwrapped_numel=n)``, the signature PyTorch FSDP
users write with ``functools.partial``. With ``recurse=True`` it answers "may units be made inside
``m``?"; with ``recurse=False``, "is ``m`` itself a unit?", ``n`` being the parameters of ``m`` not
already in a unit below it.

Example:
    >>> policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    >>> policy = functools.partial(size_based_auto_wrap_policy, min_num_params=int(1e7))
"""

from __future__ import annotations

import inspect
from typing import Callable, Iterable

import torch.nn as nn


def always_wrap_policy(*args, **kwargs) -> bool:
    """Every module is a unit."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """A unit wherever ``lambda_fn(module)`` is true."""
    if recurse:
        return True
    return bool(lambda_fn(module))


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type]) -> bool:
    """A unit for each instance of the given layer classes (e.g. a transformer block); one class
    is accepted as well as a set of them."""
    if recurse:
        return True
    return isinstance(module, _layer_classes(transformer_layer_cls))


def _layer_classes(transformer_layer_cls) -> tuple:
    classes = ((transformer_layer_cls,) if isinstance(transformer_layer_cls, type)
               else tuple(transformer_layer_cls))
    for c in classes:
        if not isinstance(c, type):
            raise TypeError(
                f"transformer_layer_cls must hold module classes, got {c!r} in "
                f"{transformer_layer_cls!r}; pass e.g. transformer_layer_cls={{Block}}.")
    return classes


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8), force_leaf_modules=None,
                                exclude_wrap_modules=None) -> bool:
    """A unit for each module holding at least ``min_num_params`` parameters not yet in a unit.

    ``force_leaf_modules`` (default ``{nn.MultiheadAttention}``) are never split further;
    ``exclude_wrap_modules`` (default ``{nn.ModuleList, nn.ModuleDict}``) are never units.
    """
    force_leaf = tuple(size_based_auto_wrap_policy.FORCE_LEAF_MODULES
                       if force_leaf_modules is None else force_leaf_modules)
    exclude = tuple(size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES
                    if exclude_wrap_modules is None else exclude_wrap_modules)
    is_large = nonwrapped_numel >= min_num_params
    if recurse:
        return is_large and not isinstance(module, force_leaf)
    return is_large and not isinstance(module, exclude)


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}


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
