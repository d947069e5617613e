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
    """A unit for each instance of the given layer classes (e.g. a transformer block)."""
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


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


def select_units(root: nn.Module, policy) -> list[nn.Module]:
    """The modules that become units, innermost first; the root is always the last one."""
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
