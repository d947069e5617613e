"""``torch_xla.experimental.spmd_fully_sharded_data_parallel`` (FSDPv2): xshard's FSDP, under
torch_xla's signature ``(module, mesh=None, shard_output=None, auto_wrap_policy=None,
auto_wrapper_callable=None, extra_data_axis=None)``.

``auto_wrapper_callable`` is called on each unit the policy selects, as torch_xla calls it, with
its inner ``SpmdFullyShardedDataParallel(...)`` call returning the unit as it is: the documented
recipe ``lambda m, *a, **k: FSDPv2(checkpoint_module(m), *a, **k)`` checkpoints every unit. It
must wrap in place (return the module it was given), as ``checkpoint_module`` does.

Example:
    >>> from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
    ...     SpmdFullyShardedDataParallel as FSDPv2)
    >>> model = FSDPv2(model, mesh)        # doctest: +SKIP
"""

from __future__ import annotations

from xshard.compat.fsdp import _attach_torch_xla_methods, _inner, _wrap_units
from xshard.fsdp import FSDP


def SpmdFullyShardedDataParallel(module, mesh=None, shard_output=None, auto_wrap_policy=None,
                                 auto_wrapper_callable=None, extra_data_axis=None, **kwargs):
    """xshard's ``FSDP(module, mesh=mesh, ...)`` (see the module docstring); returns the wrapped
    module. Inside ``auto_wrapper_callable`` it returns ``module`` unchanged."""
    if _inner():
        return module
    if kwargs:
        raise TypeError(f"SpmdFullyShardedDataParallel got unknown options {sorted(kwargs)}; "
                        f"it takes mesh, shard_output, auto_wrap_policy, auto_wrapper_callable "
                        f"and extra_data_axis.")
    _wrap_units(module, auto_wrap_policy, auto_wrapper_callable, mesh=mesh,
                shard_output=shard_output)
    return _attach_torch_xla_methods(FSDP(module, mesh=mesh, auto_wrap_policy=auto_wrap_policy,
                                          shard_output=shard_output,
                                          extra_data_axis=extra_data_axis))


__all__ = ["SpmdFullyShardedDataParallel"]
