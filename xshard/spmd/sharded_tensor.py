"""XLAShardedTensor: a device tensor seen together with its shards.

It aliases the annotated tensor's storage (like ``t.detach()``), so it can be used in ordinary tensor
ops; ``global_tensor`` is the tensor it was made from (the one autograd tracks).
"""

from __future__ import annotations

import dataclasses
from types import EllipsisType

import numpy as np
import torch

from xshard.core import api as core
from xshard.core import ir, runtime
from xshard.core.dtypes import numpy_to_torch, torch_to_numpy
from xshard.core.tensor import XTensor
from xshard.spmd import sharding as sh
from xshard.spmd import spec as specs
from xshard.spmd.spec import ShardingType


@dataclasses.dataclass
class XLAShard:
    """One device's block of a sharded tensor.

    Attributes:
        data: the block on CPU, including the padding of uneven shards.
        indices: a list with one ``slice`` per dimension into the unpadded global tensor (as in
            PyTorch/XLA), or ``Ellipsis`` when every device holds the whole tensor.
        shard_device: the device holding it, by its mesh device id (its position in
            ``xshard.devices()``), e.g. ``'CPU:3'``.
        replica_id: 0 for tiled shards; the position in its replication group for partially
            replicated ones; the mesh device id for fully replicated tensors.
    """

    data: torch.Tensor
    indices: list | EllipsisType
    shard_device: str
    replica_id: int

    @property
    def unpadded_data(self) -> torch.Tensor:
        """``data`` without the padding."""
        if self.indices is Ellipsis:
            return self.data
        return core.crop_host(self.data, self._extent())

    @unpadded_data.setter
    def unpadded_data(self, value: torch.Tensor) -> None:
        value = value.clone()
        self.data = value if self.indices is Ellipsis else core.pad_host(value, self.data.shape)

    def _extent(self) -> tuple:
        return tuple(s.stop - s.start for s in self.indices)


def _device_name(device) -> str:
    return f"{device.platform.upper()}:{runtime.position(device)}"


class XLAShardedTensor(XTensor):
    """A sharded device tensor; see ``xshard.spmd.mark_sharding``."""

    _global: XTensor

    @staticmethod
    def wrap(t: XTensor) -> "XLAShardedTensor":
        out = core.alias(t, XLAShardedTensor)
        out._global = t
        return out

    @property
    def global_tensor(self) -> XTensor:
        """The full logical tensor this wraps."""
        return self._global

    @property
    def sharding_spec(self) -> str:
        return get_sharding_spec(self._global)

    @property
    def sharding_type(self) -> ShardingType | None:
        return get_sharding_type(self._global)

    def _array(self):
        array = core.array(self._global)
        return core.value(self._global), array

    @property
    def local_shards(self) -> list[XLAShard]:
        """This process's devices' blocks (on CPU), ordered by mesh device id; no communication.

        In a multi-process run each process sees the blocks of its own devices only.
        """
        node, array = self._array()
        annotation = core.annotation(self)
        by_id = {}
        if annotation is not None and not annotation.manual:
            by_id = specs.shard_indices(node.shape, annotation.plan)
        shards = []
        for shard in sorted(array.addressable_shards, key=lambda s: runtime.position(s.device)):
            data = numpy_to_torch(np.asarray(shard.data))
            position = runtime.position(shard.device)
            if position in by_id:
                indices, replica = by_id[position]
            else:
                indices = _clip(shard.index, node.shape, array.shape)
                replica = position if indices is Ellipsis else shard.replica_id
            if indices is not Ellipsis:
                indices = list(indices)
            shards.append(XLAShard(data, indices, _device_name(shard.device), replica))
        return shards

    def load_local_shards_(self, shards: list[XLAShard]) -> "XLAShardedTensor":
        """Replaces the data with ``shards`` (one per device, padded shapes, as ``local_shards``).

        Raises:
            RuntimeError: wrong number of shards, a wrong shape, or the tensor is not sharded.
        """
        node, array = self._array()
        annotation = core.annotation(self)
        if annotation is None or annotation.sharding_type == ShardingType.REPLICATED:
            raise RuntimeError(
                "load_local_shards_ needs a sharded tensor; this one is replicated. Annotate it "
                "with xs.mark_sharding first.")
        devices = {_device_name(d): d for d in array.sharding.addressable_devices}
        if len(shards) != len(devices):
            raise RuntimeError(
                f"load_local_shards_ got {len(shards)} shards, the tensor has {len(devices)} "
                f"(one per device of its mesh); pass one XLAShard per device.")
        expected = annotation.shard_shape(node.shape)
        arrays = []
        for shard in shards:
            if tuple(shard.data.shape) != tuple(expected):
                raise RuntimeError(
                    f"shard for {shard.shard_device} has shape {tuple(shard.data.shape)}; every "
                    f"shard must have the padded shard shape {tuple(expected)}.")
            if shard.shard_device not in devices:
                raise RuntimeError(
                    f"shard_device {shard.shard_device!r} is not a device of this tensor; "
                    f"choices: {sorted(devices)}.")
            jax = runtime.jax_module()
            arrays.append(jax.device_put(torch_to_numpy(shard.data.to(self.dtype)),
                                         devices[shard.shard_device]))
        jax = runtime.jax_module()
        full = jax.make_array_from_single_device_arrays(
            annotation.padded_shape(node.shape), annotation.jax_sharding, arrays)
        core.write(self._global, ir.data_node(full, node.shape, node.dtype, full.sharding))
        return self

    def __repr__(self, *, tensor_contents=None):
        body = super().__repr__()
        return f"XLAShardedTensor({body}, sharding_spec={self.sharding_spec!r})"


def _clip(index, logical, padded):
    if all(s == slice(None) or (s.start in (None, 0) and s.stop in (None, n))
           for s, n in zip(index, padded)):
        return Ellipsis
    out = []
    for s, n in zip(index, logical):
        start = min(s.start or 0, n)
        stop = min(n if s.stop is None else s.stop, n)
        out.append(slice(start, stop, 1))
    return tuple(out)


# -- reading a tensor's sharding -------------------------------------------------------------


def device_tensor(t, what: str) -> XTensor:
    if isinstance(t, XLAShardedTensor):
        t = t.global_tensor
    if not isinstance(t, XTensor):
        device = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(
            f"{what} needs a tensor on the xshard device, got {device}. Move it first: "
            f"t = t.to(xshard.device()).")
    return t


def annotation_of(t: torch.Tensor):
    """The ``Annotation`` on ``t``'s storage, or None."""
    t = device_tensor(t, "annotation_of")
    return core.annotation(t)


def get_sharding_spec(t: torch.Tensor) -> str:
    """The HLO sharding string of ``t`` in PyTorch/XLA's explicit format, '' when unannotated.

    For a tensor computed by a sync without an annotation, this is the layout XLA chose (or ''
    when XLA left it replicated). Pending values without an annotation report ''.

    Example:
        >>> xs.get_sharding_spec(w)  # doctest: +SKIP
        '{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}'
    """
    t = device_tensor(t, "get_sharding_spec")
    if core.is_view(t):
        return ""
    annotation = core.annotation(t)
    if annotation is not None:
        return annotation.hlo_sharding
    value = core.value(t)
    if value.is_data and value.sharding is not None:
        text = sh.hlo_string_of_jax_sharding(value.payload.sharding, len(value.shape))
        return "" if text == "{replicated}" else text
    return ""


def get_sharding_type(t: torch.Tensor) -> ShardingType | None:
    """``ShardingType`` of ``t`` (REPLICATED, TILED, PARTIAL, MANUAL...), or None if unannotated."""
    t = device_tensor(t, "get_sharding_type")
    annotation = core.annotation(t) if not core.is_view(t) else None
    if annotation is not None:
        return annotation.sharding_type
    return sh.type_of_hlo_string(get_sharding_spec(t))


def wrap_if_sharded(x):
    """``XLAShardedTensor`` for a device tensor that has a sharding, else ``x`` unchanged."""
    if isinstance(x, XTensor) and not isinstance(x, XLAShardedTensor) and get_sharding_spec(x):
        return XLAShardedTensor.wrap(x)
    return x
