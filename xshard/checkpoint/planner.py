"""DCP planners for xshard tensors: save each process's own blocks, load into the current sharding.

``torch.distributed.checkpoint`` (DCP) asks a planner what to write (``create_local_plan``, then
``resolve_data`` per item) and what to read (``create_local_plan``, then ``resolve_tensor`` /
``commit_tensor`` per item). These planners extend PyTorch's default ones, which flatten nested
state dicts and handle CPU tensors and Python values, with xshard device tensors:

- Save: a device tensor becomes one ``SHARD`` write item per block this process holds with
  ``replica_id`` 0 (see ``layout``): every block is written exactly once over all processes, a
  replicated tensor by the process holding its first replica. CPU tensors and Python values are
  written by the coordinator (process 0) only.
- Load: the state to load into is checked against the checkpoint's metadata first (keys, global
  shapes, dtypes, tensor or not); then each distinct block this process's devices hold in the
  tensor's *current* sharding gets a host buffer and read items for the saved chunks overlapping it
  (DCP's ``create_read_items_for_chunk_list``); a complete tensor becomes a ``jax.Array`` through
  ``jax.make_array_from_callback`` (each process builds its own shards, no collective) and is
  written into the tensor, which keeps its storage and annotation.

The files are standard DCP: ``dcp_to_torch_save`` consolidates them, and any DCP planner reads them.
"""

from __future__ import annotations

import difflib
import functools
import io
import math
from typing import Callable

import jax
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, ReadItem, SavePlan,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from xshard.checkpoint import layout
from xshard.checkpoint.errors import CheckpointError
from xshard.core import api, runtime
from xshard.core.dtypes import numpy_to_torch

__all__ = ["SavePlanner", "LoadPlanner"]


def check_process_group() -> None:
    """Several processes must share a torch process group, or each would write a checkpoint of its
    own blocks only, with metadata describing just those."""
    if runtime.process_count() > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"This run has {runtime.process_count()} processes but no torch.distributed process "
            f"group, which DCP needs to agree on one checkpoint. Call xshard.initialize() at the "
            f"top of the script (it creates a gloo group), or "
            f"torch.distributed.init_process_group('gloo') yourself.")


def _settle(values) -> None:
    """One sync for every pending device tensor, rather than one per tensor read."""
    if any(api.is_device_tensor(v) and not api.settled(v) for v in values):
        api.sync()


def _describe(t: torch.Tensor) -> str:
    return f"a tensor of shape {tuple(t.shape)} and dtype {t.dtype}"


def _describe_saved(md: TensorStorageMetadata) -> str:
    return f"a tensor of shape {tuple(md.size)} and dtype {md.properties.dtype}"


class SavePlanner(DefaultSavePlanner):
    """Writes xshard device tensors shard by shard, each block once over all processes.

    Use it with ``torch.distributed.checkpoint.save``, or through ``xshard.checkpoint.save`` (which
    also makes the save atomic). Nested dicts are flattened as by PyTorch's default planner; CPU
    tensors and Python values (a step count, hyperparameters) are written by process 0.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> state = {"model": model.state_dict(), "step": 100}
        >>> dcp.save(state, checkpoint_id="ckpt/100", planner=xcp.SavePlanner())  # doctest: +SKIP
    """

    def __init__(self):
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True)
        self._sources: dict[MetadataIndex, Callable[[], torch.Tensor]] = {}
        self._staged_mappings = None

    def stage(self, state_dict: dict) -> dict:
        """A snapshot of ``state_dict`` in host memory, for ``dcp.save`` with this planner to write
        on another thread while the devices go on (``xshard.checkpoint.async_save``): each device
        tensor as the blocks this process writes, CPU tensors cloned, Python values pickled (so
        nothing on that thread reads a device tensor a value holds). The snapshot is flat (DCP's
        flattening, done here); it is saved under the same keys and paths as ``state_dict``."""
        flat, self._staged_mappings = flatten_state_dict(state_dict)
        _settle(flat.values())
        staged = {}
        for fqn, value in flat.items():
            if api.is_device_tensor(value):
                staged[fqn] = _HostBlocks(value)
            elif isinstance(value, torch.Tensor):
                staged[fqn] = value.detach().clone()
            else:
                staged[fqn] = _Pickled(fqn, value)
        return staged

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        check_process_group()
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        if self._staged_mappings is not None:  # flattened by stage(): keep the original paths
            self.mappings = self._staged_mappings

    def create_local_plan(self) -> SavePlan:
        _settle(self.state_dict.values())
        items, self._sources = [], {}
        for fqn, value in self.state_dict.items():
            if isinstance(value, _HostBlocks):
                items += self._staged_items(fqn, value)
            elif api.is_device_tensor(value):
                items += self._device_items(fqn, value)
            elif not self.is_coordinator:
                continue
            elif isinstance(value, torch.Tensor):
                items.append(_tensor_item(fqn, tuple(value.shape), value.dtype,
                                          WriteItemType.TENSOR))
            else:
                item = WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)
                if isinstance(value, _Pickled):
                    self._sources[item.index] = value.stream
                items.append(item)
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def _device_items(self, fqn: str, t: torch.Tensor) -> list[WriteItem]:
        pairs = _blocks_to_write(t)
        blocks = [(block.chunk, functools.partial(_read_block, shard, block))
                  for block, shard in pairs]
        return self._shard_items(fqn, tuple(t.shape), t.dtype, blocks)

    def _staged_items(self, fqn: str, staged: "_HostBlocks") -> list[WriteItem]:
        blocks = [(chunk, lambda data=data: data) for chunk, data in staged.blocks]
        return self._shard_items(fqn, staged.shape, staged.dtype, blocks)

    def _shard_items(self, fqn: str, shape, dtype, blocks) -> list[WriteItem]:
        """One write item per (chunk, data source) in ``blocks``; a tensor without elements (no
        block has data) is recorded by the coordinator all the same."""
        items = []
        for chunk, source in blocks:
            item = _tensor_item(fqn, shape, dtype, WriteItemType.SHARD, chunk)
            self._sources[item.index] = source
            items.append(item)
        if math.prod(shape) == 0 and self.is_coordinator:
            item = _tensor_item(fqn, shape, dtype, WriteItemType.SHARD)
            self._sources[item.index] = functools.partial(torch.empty, shape, dtype=dtype)
            items.append(item)
        return items

    def resolve_data(self, write_item: WriteItem):
        source = self._sources.get(write_item.index)
        return super().resolve_data(write_item) if source is None else source()


def _blocks_to_write(t: torch.Tensor) -> list:
    """The (block, shard) pairs of device tensor ``t`` this process writes."""
    if api.is_view(t):  # a view has no array of its own; save a copy of its values
        t = t.clone()
    return layout.blocks_to_write(api.array(t), tuple(t.shape))


def _read_block(shard, block) -> torch.Tensor:
    # Read from the device only when DCP resolves the item, as it writes it: one block at a time
    # is on the host.
    return numpy_to_torch(jax.device_get(shard.data)[block.inside])


class _Pickled:
    """A Python value pickled as DCP writes one (``stage``)."""

    def __init__(self, fqn: str, value):
        buffer = io.BytesIO()
        try:
            torch.save(value, buffer)
        except Exception as e:
            raise CheckpointError(
                f"Key {fqn!r}: the value ({type(value).__name__}) cannot be pickled, so it cannot "
                f"be saved ({type(e).__name__}: {e}). Leave it out of the state, or save what "
                f"rebuilds it.", key=fqn) from e
        self.data = buffer.getvalue()

    def stream(self) -> io.BytesIO:
        return io.BytesIO(self.data)


class _HostBlocks:
    """A device tensor's blocks that this process writes, copied to host memory (``stage``)."""

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype = tuple(t.shape), t.dtype
        pairs = _blocks_to_write(t)
        hosts = jax.device_get([shard.data for _, shard in pairs])  # one transfer for all
        self.blocks = [(block.chunk, numpy_to_torch(host[block.inside]))
                       for (block, _), host in zip(pairs, hosts)]


def _tensor_item(fqn: str, shape: tuple, dtype: torch.dtype, kind: WriteItemType,
                 chunk=None) -> WriteItem:
    if chunk is None:
        chunk = layout.block(tuple((0, n) for n in shape), tuple(shape)).chunk
    return WriteItem(
        index=MetadataIndex(fqn, chunk.offsets),
        type=kind,
        tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=dtype),
                                    size=torch.Size(shape)))


class _Target:
    """A tensor being loaded: its blocks' host buffers, and how many elements are still to come."""

    def __init__(self, t: torch.Tensor):
        self.tensor = t
        self.shape = tuple(t.shape)
        if api.is_device_tensor(t):
            array = api.array(t)
            self.sharding, self.padded = array.sharding, tuple(array.shape)
            self.blocks = list(layout.blocks_to_fill(self.sharding, self.padded, self.shape).values())
            self.buffers = [layout.host_buffer(b.shape, t.dtype) for b in self.blocks]
        else:  # a CPU tensor (of any dtype, those devices lack too): one block, the whole tensor
            self.sharding, self.padded = None, self.shape
            self.blocks = [layout.block(tuple((0, n) for n in self.shape), self.shape)]
            self.buffers = [(None, torch.zeros(self.shape, dtype=t.dtype))]
        self.remaining = 0

    def destination(self, read_item: ReadItem) -> torch.Tensor:
        _, buffer = self.buffers[read_item.dest_index.index]
        return buffer[tuple(slice(o, o + n)
                            for o, n in zip(read_item.dest_offsets, read_item.lengths))]

    def build(self):
        """The loaded value, ready to write: a jax.Array in the tensor's sharding, or a CPU tensor."""
        if self.sharding is None:
            return self.buffers[0][1]
        position = {b.span: i for i, b in enumerate(self.blocks)}
        handed = set()

        def data(index):
            i = position[layout.span_of(index, self.padded)]
            array = self.buffers[i][0]
            # A block held by several local devices: the first gets the buffer, the others copies,
            # so no two device buffers can share host memory.
            if i in handed:
                return array.copy()
            handed.add(i)
            return array

        return jax.make_array_from_callback(self.padded, self.sharding, data)

    def write(self, value) -> None:
        if self.sharding is None:
            with torch.no_grad():
                self.tensor.copy_(value)
        else:
            api.write(self.tensor, api.data_node(value, self.shape, self.tensor.dtype))


class LoadPlanner(DefaultLoadPlanner):
    """Loads a DCP checkpoint into xshard tensors in place, each laid out as it is now.

    The checkpoint may come from any mesh, sharding or number of processes (resharding on load):
    each process reads only the saved chunks that overlap the blocks its devices hold. Every key,
    global shape and dtype is checked against the checkpoint before anything is read, and a
    mismatch raises ``CheckpointError`` naming the key and both shapes, with the state unchanged.

    Args:
        defer_writes: False (default, for ``dcp.load``): each tensor is written as soon as all its
            chunks have arrived. True: nothing is written until ``apply()`` is called, so a read
            that fails half-way changes nothing (``xshard.checkpoint.load`` does this).

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> state = {"model": model.state_dict(), "step": 0}
        >>> dcp.load(state, checkpoint_id="ckpt/100", planner=xcp.LoadPlanner())  # doctest: +SKIP
        >>> model.load_state_dict(state["model"]); step = state["step"]  # doctest: +SKIP
    """

    def __init__(self, *, defer_writes: bool = False):
        if not isinstance(defer_writes, bool):
            raise TypeError(f"defer_writes must be a bool, got {defer_writes!r}.")
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True,
                         allow_partial_load=False)
        self.defer_writes = defer_writes
        self._targets: dict[str, _Target] = {}
        self._bytes: list = []

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        check_process_group()
        # The default planner's set-up rewrites containers in place (lists become new lists, and
        # values of types it does not know become None). Give it a copy of the containers, so the
        # state stays as it was until values are written into it.
        super().set_up_planner(_copy_containers(state_dict), metadata, is_coordinator)
        self.original_state_dict = state_dict

    def create_local_plan(self) -> LoadPlan:
        check_state(self.state_dict, self.metadata, self.original_state_dict.keys())
        _settle(self.state_dict.values())
        items: list[ReadItem] = []
        self._targets, self._bytes = {}, []
        for fqn, value in self.state_dict.items():
            saved = self.metadata.state_dict_metadata[fqn]
            if isinstance(saved, BytesStorageMetadata):
                items.append(ReadItem(
                    type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn),
                    dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(fqn),
                    storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
                continue
            target = _Target(value)
            reads = create_read_items_for_chunk_list(fqn, saved, [b.chunk for b in target.blocks])
            target.remaining = sum(math.prod(r.lengths) for r in reads)
            wanted = sum(b.numel for b in target.blocks)
            if target.remaining != wanted:
                raise CheckpointError(
                    f"Key {fqn!r}: the checkpoint's chunks cover {target.remaining} of the "
                    f"{wanted} elements this process needs; its metadata is damaged. Save it "
                    f"again.", key=fqn, expected=wanted, found=target.remaining)
            self._targets[fqn] = target
            items += reads
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self._targets[read_item.dest_index.fqn].destination(read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        target = self._targets[read_item.dest_index.fqn]
        target.remaining -= math.prod(read_item.lengths)
        if target.remaining == 0 and not self.defer_writes:
            target.write(target.build())

    def load_bytes(self, read_item: ReadItem, value) -> None:
        if self.defer_writes:
            self._bytes.append((read_item, value.read()))
        else:
            self._set_value(read_item.dest_index.fqn, value)

    def _set_value(self, fqn: str, data) -> None:
        value = torch.load(data, weights_only=False)
        path = self.mappings.get(fqn, (fqn,))
        set_by_path(self.original_state_dict, path, value)

    def apply(self) -> dict:
        """Writes everything read (``defer_writes=True``): every tensor, then every Python value.

        Returns:
            The state dict DCP was given, with its Python values replaced by the loaded ones.

        Raises:
            RuntimeError: some chunks were never read (the load did not finish).
        """
        if not self.defer_writes:  # dcp.load has written everything already
            return self.original_state_dict
        missing = [fqn for fqn, t in self._targets.items() if t.remaining]
        if missing:
            raise RuntimeError(
                f"apply() before the load finished: {len(missing)} tensors still miss chunks "
                f"(e.g. {missing[0]!r}). Call it after dcp.load returns.")
        built = [(t, t.build()) for t in self._targets.values()]
        for target, value in built:
            target.write(value)
        for read_item, data in self._bytes:
            self._set_value(read_item.dest_index.fqn, io.BytesIO(data))
        self._targets, self._bytes = {}, []
        return self.original_state_dict


def _copy_containers(value):
    """``value`` with its dicts and lists copied, everything else shared."""
    if isinstance(value, dict):
        return {k: _copy_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_containers(v) for v in value]
    return value


def set_by_path(root: dict, path: tuple, value) -> None:
    """Puts ``value`` at ``path`` (DCP's flattening path) inside ``root``.

    DCP turns every dict key into a string (an optimizer's state keys 0, 1, ... become '0', '1');
    the key a path component stands for is the container's own key of that spelling, so the value
    replaces the old one instead of landing beside it under a new string key.
    """
    container = root
    for i, step in enumerate(path):
        if isinstance(container, dict):
            key = step if step in container else next(
                (k for k in container if str(k) == step), step)
        else:
            key = step
        if i == len(path) - 1:
            container[key] = value
        else:
            container = container[key]


def check_state(flat_state: dict, metadata, top_keys) -> None:
    """Raises ``CheckpointError`` unless every entry of ``flat_state`` is in the checkpoint with the
    same global shape and dtype (or is a Python value there too), and the checkpoint has no entry
    under one of ``top_keys`` that the state lacks (an optimizer without state would otherwise load
    nothing, silently)."""
    saved = metadata.state_dict_metadata
    problems: list[CheckpointError] = []
    for fqn, value in flat_state.items():
        md = saved.get(fqn)
        expected = _describe(value) if isinstance(value, torch.Tensor) else \
            f"a {type(value).__name__} value"
        if md is None:
            near = difflib.get_close_matches(fqn, list(saved), n=3)
            hint = f" Closest saved keys: {near}." if near else ""
            problems.append(CheckpointError(
                f"Key {fqn!r} of the state to load into is not in the checkpoint, which holds "
                f"{len(saved)} entries.{hint} Load a checkpoint saved from the same model and "
                f"optimizer, or leave this key out of the state.",
                key=fqn, expected=expected, found=None))
        elif isinstance(md, TensorStorageMetadata):
            found = _describe_saved(md)
            if not isinstance(value, torch.Tensor):
                problems.append(CheckpointError(
                    f"Key {fqn!r}: the checkpoint holds {found}; the state to load into holds "
                    f"{expected}. Put a tensor of that shape there to load into.",
                    key=fqn, expected=expected, found=found))
            elif tuple(md.size) != tuple(value.shape) or md.properties.dtype != value.dtype:
                problems.append(CheckpointError(
                    f"Key {fqn!r}: the checkpoint holds {found}; the state to load into has "
                    f"{expected}. A checkpoint loads onto any mesh, sharding or number of "
                    f"processes, but not into another global shape or dtype: build the model "
                    f"with the configuration it was saved with.",
                    key=fqn, expected=(tuple(value.shape), value.dtype),
                    found=(tuple(md.size), md.properties.dtype)))
            elif api.is_device_tensor(value) and api.is_view(value):
                problems.append(CheckpointError(
                    f"Key {fqn!r}: the state holds a view of another tensor; load into the "
                    f"base tensor (a view has no storage of its own to write).",
                    key=fqn, expected=expected, found=found))
        elif isinstance(value, torch.Tensor):
            problems.append(CheckpointError(
                f"Key {fqn!r}: the checkpoint holds a Python value, not a tensor; the state to "
                f"load into holds {expected}. Load a checkpoint saved from the same state.",
                key=fqn, expected=expected, found="a Python value"))
    paths = metadata.planner_data or {}
    top_keys = set(top_keys)
    extra: dict = {}
    for fqn in saved:
        top = paths[fqn][0] if fqn in paths else fqn.split(".")[0]
        if fqn not in flat_state and top in top_keys:
            extra.setdefault(top, []).append(fqn)
    for top, keys in extra.items():
        problems.append(CheckpointError(
            f"The checkpoint holds {len(keys)} entries under {top!r} that the state to load into "
            f"lacks, e.g. {keys[:3]}. If {top!r} is an optimizer that has not stepped yet, it has "
            f"no state to load into: pass the optimizer itself to xshard.checkpoint.load, or "
            f"call xshard.checkpoint.prime_optimizer(opt) before opt.state_dict(). Otherwise "
            f"the model or optimizer differs from the one saved.",
            key=keys[0], expected=None, found=f"{len(keys)} more entries"))
    if problems:
        first = problems[0]
        if len(problems) > 1:
            others = [p.key for p in problems[1:4]]
            more = f" ({len(problems) - 1} more problems, e.g. with keys {others}.)"
            raise CheckpointError(str(first) + more, key=first.key, expected=first.expected,
                                  found=first.found)
        raise first
