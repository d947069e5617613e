"""FSDP state dicts: full (CPU tensors) or sharded (each tensor's local shards), loadable anywhere.

A sharded entry keeps its global shape and the block each shard covers, so a checkpoint saved on 8
devices is reassembled on CPU and loads on 4 devices, or 1.
"""

from __future__ import annotations

import dataclasses

import torch

from xshard.core import api as core
from xshard.core.tensor import XTensor
from xshard.spmd.sharded_tensor import XLAShardedTensor, get_sharding_spec


@dataclasses.dataclass
class ShardedEntry:
    """One tensor of a sharded state dict.

    Attributes:
        global_shape: the full (unpadded) shape.
        dtype: its dtype.
        sharding_spec: the HLO sharding string it had ('' when replicated).
        shards: (indices, data) pairs: the slices of the global tensor and the CPU data there
            (one per distinct block; replicas are stored once).
    """

    global_shape: tuple
    dtype: torch.dtype
    sharding_spec: str
    shards: list

    def full(self) -> torch.Tensor:
        out = torch.empty(self.global_shape, dtype=self.dtype)
        for indices, data in self.shards:
            if indices is Ellipsis:
                return data.clone()
            out[indices] = data
        return out


def full_state_dict(root, state: dict) -> dict:
    core.sync()
    return {k: core.to_cpu(v) if isinstance(v, XTensor) else v for k, v in state.items()}


def sharded_state_dict(root, state: dict) -> dict:
    core.sync()
    out = {}
    for key, value in state.items():
        if not isinstance(value, XTensor):
            out[key] = value
            continue
        shards, seen = [], set()
        for shard in XLAShardedTensor.wrap(value).local_shards:
            block = repr(shard.indices)
            if block in seen:
                continue
            seen.add(block)
            shards.append((shard.indices, shard.unpadded_data.clone()))
        out[key] = ShardedEntry(tuple(value.shape), value.dtype, get_sharding_spec(value), shards)
    return out


def to_full(state: dict) -> dict:
    """A state dict with every ``ShardedEntry`` reassembled into a full CPU tensor."""
    return {k: v.full() if isinstance(v, ShardedEntry) else v for k, v in state.items()}
