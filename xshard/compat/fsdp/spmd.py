"""``torch_xla.experimental.spmd_fully_sharded_data_parallel`` (FSDPv2): xshard's FSDP, which
takes the same arguments (``mesh`` with an ``fsdp`` axis, ``shard_output``,
``auto_wrap_policy``, ``extra_data_axis``).

Example:
    >>> from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
    ...     SpmdFullyShardedDataParallel as FSDPv2)
    >>> model = FSDPv2(model, mesh=mesh)        # doctest: +SKIP
"""

from xshard.fsdp import FSDP

SpmdFullyShardedDataParallel = FSDP

__all__ = ["SpmdFullyShardedDataParallel"]
