"""``torch_xla.distributed.fsdp`` on xshard: ``XlaFullyShardedDataParallel`` is xshard's FSDP.

torch_xla's FSDP (v1) shards parameters over the processes of ``xmp.spawn`` and reduce-scatters
gradients between them. xshard's FSDP shards them over the devices of one program, with the same
numbers (the gradient of the global batch, averaged), so a script that wraps its model runs as one
program: plain, ``nprocs=1``, or after ``xr.use_spmd()``. Under ``xmp.spawn`` replicas, where
each process is a world of one device, it raises and says so.

Options that only tune torch_xla's implementation (flattening, bucket sizes, layout pinning) are
accepted and have no effect; the optimization-barrier options are xshard's FSDP's own; options with
no counterpart raise.

Example:
    >>> from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
    >>> from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    >>> policy = partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    >>> model = FSDP(model, auto_wrap_policy=policy)         # doctest: +SKIP
"""

from __future__ import annotations

import functools

import torch

from xshard.compat import _world
from xshard.fsdp import FSDP, MixedPrecision, checkpoint_module  # noqa: F401
from xshard.fsdp.wrap import select_units
from xshard.compat.fsdp.wrap import (always_wrap_policy, lambda_auto_wrap_policy,  # noqa: F401
                                     size_based_auto_wrap_policy, transformer_auto_wrap_policy)

# torch_xla options that tune its own implementation: no effect on the numbers, none here.
_IGNORED = {
    "flatten_parameters", "execute_sharding_on_init", "disable_reshard_on_root",
    "pin_layout_in_collective_ops",
    "reduce_scatter_bucket_size_mb", "coalesce_all_gather_ops", "_shard_size_multiple",
    "_use_xla_patched_linear", "sync_on_finalization", "mark_step_on_finalization",
}
_REFUSED = {
    "param_init_fn": "materialise the parameters before wrapping",
    "sharding_groups": "shard over a mesh axis instead: xshard.fsdp.FSDP(module, mesh=...)",
    "sharding_rank": "shard over a mesh axis instead: xshard.fsdp.FSDP(module, mesh=...)",
    "sharding_world_size": "shard over a mesh axis instead: xshard.fsdp.FSDP(module, mesh=...)",
}


class _FSDPType(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, FSDP)


class XlaFullyShardedDataParallel(metaclass=_FSDPType):
    """``XlaFullyShardedDataParallel(module, **torch_xla_options)``: xshard's ``FSDP`` over every
    device of the program (see the module docstring). Returns the wrapped module.

    Args:
        module: the model.
        reshard_after_forward, shard_param_on_dim_0, auto_wrap_policy,
        optimization_barrier_in_forward, optimization_barrier_in_backward: as in torch_xla.
        auto_wrapper_callable: called on each unit, as in torch_xla (its recipe
            ``lambda m, *a, **k: FSDP(checkpoint_module(m), *a, **k)`` checkpoints the units);
            the FSDP call inside returns the unit as it is, and it must change the unit in place.
        compute_dtype: dtype of the computation (default float32; e.g. torch.bfloat16).
        buffer_dtype: dtype of the buffers (default ``compute_dtype``).
        fp32_reduce_scatter: reduce gradients in float32 when ``compute_dtype`` is lower.

    Example:
        >>> model = XlaFullyShardedDataParallel(model,
        ...                                     compute_dtype=torch.bfloat16)  # doctest: +SKIP
    """

    def __new__(cls, module, *, reshard_after_forward: bool = True,
                shard_param_on_dim_0: bool = False, auto_wrap_policy=None,
                auto_wrapper_callable=None, compute_dtype=None, buffer_dtype=None,
                fp32_reduce_scatter: bool = False, optimization_barrier_in_forward: bool = True,
                optimization_barrier_in_backward: bool = True, **options):
        if _inner():
            return module
        for name, value in options.items():
            if name in _REFUSED:
                if value is not None:
                    raise NotImplementedError(f"XlaFullyShardedDataParallel({name}=...) has no "
                                              f"counterpart here: {_REFUSED[name]}.")
            elif name not in _IGNORED and not name.startswith("_debug"):
                raise TypeError(f"XlaFullyShardedDataParallel got an unknown option {name!r}.")
        if _world.replicas():
            raise NotImplementedError(
                f"XlaFullyShardedDataParallel in a process of xmp.spawn ({_world.world_size()} "
                f"replicas): here each replica is a world of one device, and xshard's FSDP shards "
                f"over the devices of one program. Run the script as one program over every "
                f"device (nprocs=1 or xr.use_spmd()), where it is xshard's FSDP with the same "
                f"numbers; or train the replicas unsharded with xm.optimizer_step.")
        if any(isinstance(m, FSDP) for m in module.modules()):
            raise NotImplementedError(
                "XlaFullyShardedDataParallel around modules already wrapped (nested wrapping) is "
                "not supported; wrap the root once and choose the inner units with "
                "auto_wrap_policy, e.g. partial(lambda_auto_wrap_policy, lambda_fn=lambda m: "
                "isinstance(m, Block)).")
        _wrap_units(module, auto_wrap_policy, auto_wrapper_callable)
        mixed = None
        if compute_dtype not in (None, torch.float32):
            mixed = MixedPrecision(param_dtype=compute_dtype,
                                   reduce_dtype=torch.float32 if fp32_reduce_scatter else None,
                                   buffer_dtype=buffer_dtype or compute_dtype)
        elif buffer_dtype not in (None, torch.float32):
            mixed = MixedPrecision(buffer_dtype=buffer_dtype)
        return _attach_torch_xla_methods(FSDP(
            module, auto_wrap_policy=auto_wrap_policy, reshard_after_forward=reshard_after_forward,
            shard_param_on_dim_0=shard_param_on_dim_0, mixed_precision=mixed,
            optimization_barrier_in_forward=optimization_barrier_in_forward,
            optimization_barrier_in_backward=optimization_barrier_in_backward))


_INNER = {"depth": 0}  # > 0 while an auto_wrapper_callable runs on a unit


def _inner() -> bool:
    """Whether an ``auto_wrapper_callable`` is running: the FSDP call inside it returns its
    module as it is (the root's FSDP shards the unit)."""
    return _INNER["depth"] > 0


def _wrap_units(module, policy, wrapper, **kwargs) -> None:
    """Calls ``wrapper`` (torch_xla's ``auto_wrapper_callable``) on each unit ``policy`` selects,
    as torch_xla does, so its recipe ``lambda m, *a, **k: FSDP(checkpoint_module(m), *a, **k)``
    checkpoints every unit. The wrapper must change the unit in place."""
    if wrapper is None:
        return
    if policy is None:
        raise ValueError("auto_wrapper_callable=...) needs an auto_wrap_policy choosing the units "
                         "it is called on.")
    _INNER["depth"] += 1
    try:
        for unit in select_units(module, policy)[:-1]:  # the root comes last
            if wrapper(unit, **kwargs) is not unit:
                raise TypeError(
                    f"auto_wrapper_callable returned another module than the "
                    f"{type(unit).__name__} it was given; here it must change the unit in place, "
                    f"as FSDP(checkpoint_module(m)) does.")
    finally:
        _INNER["depth"] -= 1


def _attach_torch_xla_methods(model):
    """``model`` with torch_xla's FSDP methods that xshard's FSDP has no use for."""
    object.__setattr__(model, "get_shard_metadata", functools.partial(_shard_metadata, model))
    return model


def _shard_metadata(model) -> dict:
    """torch_xla's ``get_shard_metadata()``, for its checkpoint recipe ({'model':
    model.state_dict(), 'shard_metadata': model.get_shard_metadata()}): xshard's state_dict()
    holds whole tensors, so no shard needs describing and nothing needs consolidating."""
    return {"shard_info": {}, "flatten_info": {}, "buffer_info": {},
            "xshard": "state_dict() holds whole tensors; load it with model.load_state_dict"}


def consolidate_sharded_state_dicts(*args, **kwargs):
    raise NotImplementedError(
        "consolidate_sharded_state_dicts: xshard's FSDP state_dict() already holds whole "
        "tensors; save it with xm.save(model.state_dict(), path).")


def consolidate_sharded_model_checkpoints(*args, **kwargs):
    raise NotImplementedError(
        "consolidate_sharded_model_checkpoints: xshard's FSDP state_dict() already holds whole "
        "tensors; save it with xm.save(model.state_dict(), path), or use xshard.checkpoint.")


__all__ = ["XlaFullyShardedDataParallel", "checkpoint_module", "always_wrap_policy",
           "lambda_auto_wrap_policy", "size_based_auto_wrap_policy",
           "transformer_auto_wrap_policy", "consolidate_sharded_state_dicts",
           "consolidate_sharded_model_checkpoints"]
