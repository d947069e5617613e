"""Fully sharded data parallel built on sharding annotations (see [Note: FSDP as annotations]).

Example:
    >>> from functools import partial
    >>> from xshard.fsdp import FSDP, transformer_auto_wrap_policy
    >>> model = FSDP(GPT(cfg), auto_wrap_policy=partial(transformer_auto_wrap_policy,
    ...                                                 transformer_layer_cls={Block}))

Module order (each imports only those before it): wrap (policies, PyTorch's), mixed_precision,
partial (no_sync's per-device partial sums), state_dict <- fully_shard (FSDP, units) <- utils.
"""

from xshard.fsdp.fully_shard import (FSDP, FSDP_AXIS, ParametersDifferError, TrainingState,
                                     param_annotation)
from xshard.fsdp.mixed_precision import MixedPrecision
from xshard.fsdp.state_dict import IncompleteShardsError, ShardedEntry, to_full
from xshard.fsdp.utils import checkpoint_module
from xshard.fsdp.wrap import (ModuleWrapPolicy, always_wrap_policy, lambda_auto_wrap_policy,
                              select_units, size_based_auto_wrap_policy,
                              transformer_auto_wrap_policy)

FullyShardedDataParallel = FSDP
SpmdFullyShardedDataParallel = FSDP

__all__ = ["FSDP", "FullyShardedDataParallel", "SpmdFullyShardedDataParallel", "FSDP_AXIS",
           "MixedPrecision", "TrainingState", "ShardedEntry", "IncompleteShardsError", "to_full",
           "ParametersDifferError", "checkpoint_module",
           "ModuleWrapPolicy", "always_wrap_policy", "lambda_auto_wrap_policy",
           "size_based_auto_wrap_policy", "transformer_auto_wrap_policy", "select_units",
           "param_annotation"]
