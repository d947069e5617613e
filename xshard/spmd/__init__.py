"""GSPMD-style sharding: annotate a few tensors, XLA's partitioner does the rest.

Example:
    >>> import numpy as np, torch, xshard
    >>> import xshard.spmd as xs
    >>> mesh = xs.Mesh(np.arange(8), (4, 2), ("data", "model"))
    >>> w = torch.randn(16, 32, device=xshard.device())
    >>> xs.mark_sharding(w, mesh, ("model", None))    # doctest: +SKIP
    >>> xs.get_sharding_spec(w)                        # doctest: +SKIP
    '{devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}'

Module order (each imports only those before it): spec (device-free math) <- sharding (annotations)
<- sharded_tensor (XLAShardedTensor, reading a tensor's sharding) <- api (mark, clear) <- manual
(regions and collectives) <- loader (input sharding) <- debugging.
"""

from xshard.mesh import AbstractMesh, HybridMesh, Mesh, get_1d_mesh, get_global_mesh, set_global_mesh
from xshard.spmd.api import (annotation_of, clear_sharding, get_sharding_spec, get_sharding_type,
                             mark_sharding, mark_sharding_with_gradients, wrap_if_sharded)
from xshard.spmd.sharded_tensor import XLAShard, XLAShardedTensor
from xshard.spmd.spec import PartitionSpecError, ShardingType

__all__ = [
    "AbstractMesh", "HybridMesh", "Mesh", "get_1d_mesh", "get_global_mesh", "set_global_mesh",
    "mark_sharding", "clear_sharding", "mark_sharding_with_gradients", "get_sharding_spec",
    "get_sharding_type", "wrap_if_sharded", "annotation_of", "XLAShardedTensor", "XLAShard",
    "ShardingType", "PartitionSpecError",
]

from xshard.spmd.manual import (all_gather, all_reduce, all_to_all, disable_manual_sharding,  # noqa
                                enable_manual_sharding, ppermute, reduce_scatter, shard_map)

__all__ += ["enable_manual_sharding", "disable_manual_sharding", "shard_map", "all_reduce",
            "all_gather", "reduce_scatter", "all_to_all", "ppermute"]

from xshard.spmd.loader import MpDeviceLoader, ShardingSpec, send_cpu_data_to_device  # noqa: E402
from xshard.spmd.debugging import visualize_sharding, visualize_tensor_sharding  # noqa: E402

__all__ += ["ShardingSpec", "MpDeviceLoader", "send_cpu_data_to_device", "visualize_sharding",
            "visualize_tensor_sharding"]
