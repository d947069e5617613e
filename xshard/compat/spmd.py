"""``torch_xla.distributed.spmd`` (``xs``) on xshard: ``xshard.spmd`` under torch_xla's names
(``Mesh``, ``HybridMesh``, ``mark_sharding``, ``clear_sharding``, ``ShardingSpec``,
``XLAShardedTensor``, ``set_global_mesh``, ``enable_manual_sharding``, ...).

Example:
    >>> import torch_xla.distributed.spmd as xs
    >>> mesh = xs.Mesh(np.arange(8), (8,), ("data",))
    >>> xs.mark_sharding(batch, mesh, ("data", None))   # doctest: +SKIP
"""

from xshard.spmd import *  # noqa: F401,F403
from xshard.spmd import __all__  # noqa: F401
