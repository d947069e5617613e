"""FSDP state dicts: full (CPU tensors) or sharded (each tensor's local shards), loadable anywhere.

A sharded entry keeps its global shape and the block each shard covers, so a checkpoint saved on 8
devices is reassembled on CPU and loads on 4 devices, or 1. In a multi-process run each process's
sharded state dict holds the blocks of its own devices only: such entries are incomplete, and
``to_full`` refuses them rather than fill the holes; ``FSDP.state_dict()`` gathers full tensors
(a collective), and ``torch.distributed.checkpoint`` saves the blocks where they are.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from xshard.core import api as core
from xshard.core import distributed
from xshard.core.tensor import XTensor
from xshard.spmd.sharded_tensor import XLAShardedTensor, get_sharding_spec


class IncompleteShardsError(ValueError):
    """A sharded state dict entry does not hold every block of its tensor."""


@dataclasses.dataclass
class ShardedEntry:
    """One tensor of a sharded state dict.

    Attributes:
        global_shape: the full (unpadded) shape.
        dtype: its dtype.
        sharding_spec: the HLO sharding string it had ('' when replicated).
        shards: (indices, data) pairs: the slices of the global tensor and the CPU data there
            (one per distinct block; replicas are stored once).
        process_index: the process whose devices held these shards.
    """

    global_shape: tuple
    dtype: torch.dtype
    sharding_spec: str
    shards: list
    process_index: int = 0

    @property
    def covered(self) -> int:
        """How many elements of the global tensor the blocks hold (distinct blocks are disjoint)."""
        total = math.prod(self.global_shape)
        count = 0
        for indices, _ in self.shards:
            if indices is Ellipsis:
                return total
            count += math.prod(s.stop - s.start for s in indices)
        return count

    @property
    def complete(self) -> bool:
        """Whether the blocks cover the whole tensor."""
        return self.covered == math.prod(self.global_shape)

    def full(self) -> torch.Tensor:
        """The whole tensor on CPU.

        Raises:
            IncompleteShardsError: some blocks live on other processes.
        """
        if not self.complete:
            raise IncompleteShardsError(
                f"this entry holds {len(self.shards)} blocks covering {self.covered} of "
                f"{math.prod(self.global_shape)} elements of a {tuple(self.global_shape)} tensor "
                f"(process {self.process_index}'s devices' blocks, sharding "
                f"{self.sharding_spec}); the others live on other processes. Gather full tensors "
                f"with model.state_dict() (a collective: call it on every process), or save the "
                f"blocks where they are with torch.distributed.checkpoint.")
        out = torch.empty(self.global_shape, dtype=self.dtype)
        for indices, data in self.shards:
            if indices is Ellipsis:
                return data.clone()
            out[tuple(indices)] = data
        return out


def full_state_dict(root, state: dict, rank0_only: bool = False) -> dict:
    """``state`` with device tensors read to CPU (gathered across processes where sharded)."""
    core.sync()
    keep = not rank0_only or distributed.is_main_process()
    out = {}
    for key, value in state.items():
        if isinstance(value, XTensor):
            value = core.to_cpu(value)  # collective when the value spans processes
        if keep:
            out[key] = value
    return out


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
        out[key] = ShardedEntry(tuple(value.shape), value.dtype, get_sharding_spec(value), shards,
                                distributed.process_id())
    return out


def to_full(state: dict) -> dict:
    """A state dict with every ``ShardedEntry`` reassembled into a full CPU tensor.

    Raises:
        IncompleteShardsError: an entry lacks blocks held by other processes.
    """
    out = {}
    for key, value in state.items():
        if isinstance(value, ShardedEntry):
            try:
                value = value.full()
            except IncompleteShardsError as e:
                raise IncompleteShardsError(f"state dict entry {key!r}: {e}") from None
        out[key] = value
    return out
