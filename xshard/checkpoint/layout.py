"""Block geometry: which blocks of a tensor this process writes, and which it must fill on load.

Works on a ``jax.Array`` (or its sharding) and the tensor's logical shape; no collective runs.

A device's block is ``shard.index`` into the **padded** array (xshard pads uneven shardings at the
end of each dimension, see ``Annotation.padded_shape``). Its **chunk** is the part inside the
logical tensor: the index clipped to the logical shape, in DCP's terms
``ChunkStorageMetadata(offsets, sizes)``. Example, shape (9, 5) split 8 ways on dim 0 (padded to
(16, 5), blocks of 2 rows): device 4 holds rows 8:10, its chunk is rows 8:9; devices 5-7 hold
padding only, their chunks are empty.

Save: each block is written by the one device whose ``replica_id`` is 0, so over all processes every
block is written exactly once. Load: each distinct block held by this process's devices is filled
once on the host, then handed to every local device that holds it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from xshard.core.dtypes import to_numpy_dtype

Span = tuple[tuple[int, int], ...]  # (start, stop) per dimension, in the padded array


def span_of(index: tuple, padded_shape: tuple) -> Span:
    """``index`` (a tuple of slices from jax, ``slice(None)`` meaning all) as (start, stop) pairs."""
    return tuple((s.start or 0, n if s.stop is None else s.stop)
                 for s, n in zip(index, padded_shape))


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of a tensor's padded array, and its chunk inside the logical tensor.

    Attributes:
        span: (start, stop) per dimension in the padded array.
        chunk: the block clipped to the logical shape (offsets, sizes); sizes may be 0.
    """

    span: Span
    chunk: ChunkStorageMetadata

    @property
    def shape(self) -> tuple:
        """The block's padded shape (what a device holds)."""
        return tuple(stop - start for start, stop in self.span)

    @property
    def numel(self) -> int:
        """Elements of the logical tensor inside the block."""
        return math.prod(self.chunk.sizes)

    @property
    def inside(self) -> tuple:
        """Slices of the block that lie inside the logical tensor (the rest is padding)."""
        return tuple(slice(0, n) for n in self.chunk.sizes)


def block(span: Span, logical_shape: tuple) -> Block:
    offsets, sizes = [], []
    for (start, stop), n in zip(span, logical_shape):
        offsets.append(min(start, n))
        sizes.append(max(0, min(stop, n) - start))
    return Block(span, ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))


def blocks_to_write(array, logical_shape: tuple) -> list[tuple[Block, object]]:
    """The blocks this process writes: (block, shard) for each addressable shard with replica_id 0
    and a non-empty chunk."""
    out = []
    for shard in array.addressable_shards:
        if shard.replica_id != 0:
            continue
        b = block(span_of(shard.index, array.shape), logical_shape)
        if b.numel:
            out.append((b, shard))
    return out


def blocks_to_fill(sharding, padded_shape: tuple, logical_shape: tuple) -> dict[Span, Block]:
    """The distinct blocks this process's devices hold under ``sharding`` (empty ones included)."""
    out: dict[Span, Block] = {}
    for index in sharding.addressable_devices_indices_map(tuple(padded_shape)).values():
        span = span_of(index, padded_shape)
        if span not in out:
            out[span] = block(span, logical_shape)
    return out


# Dtypes numpy holds (through ml_dtypes) but torch.from_numpy refuses: viewed through an integer
# carrier of the same width.
_CARRIERS = {torch.bfloat16: np.int16, torch.float8_e4m3fn: np.int8, torch.float8_e5m2: np.int8}


def host_buffer(shape: tuple, dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor]:
    """A zeroed host buffer as a numpy array (for jax) and a torch tensor sharing its memory (for
    DCP to read into)."""
    array = np.zeros(shape, dtype=to_numpy_dtype(dtype))
    carrier = _CARRIERS.get(dtype)
    if carrier is not None:
        return array, torch.from_numpy(array.view(carrier)).view(dtype)
    return array, torch.from_numpy(array)
