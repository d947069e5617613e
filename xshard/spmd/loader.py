"""Input sharding for data loaders: batches arrive on the devices already split into shards.

``MpDeviceLoader`` wraps any iterable of batches (a tensor, a tuple/list, or a dict of tensors;
other leaves pass through unchanged). A background thread copies batch i+1 from the host straight
into its shards (no replicated copy, and no collective: see ``xshard.core.arrays``) while step i
runs; the consumer thread only wraps the arrived data as xshard tensors.

[Note: why the background thread makes no tensors]
Creating an xshard tensor registers its storage cell with core (xshard.core.cells), which ``sync()`` reads.
The thread therefore produces only IR data nodes (plain values over ``jax.Array``s); the tensors
are made in the consumer's thread, when a batch is handed out. Likewise, in a multi-process run the
thread collects the digests of what it uploads (see ``xshard.core.divergence``) and the consumer
adds them to the next sync's check when it hands the batch out, so that the check does not depend
on how far ahead the thread is.

Example:
    >>> mesh = xs.Mesh(np.arange(8), (4, 2), ("data", "model"))
    >>> loader = xs.MpDeviceLoader(train_loader, xshard.device(),
    ...                            input_sharding=xs.ShardingSpec(mesh, ("data", None)))
    >>> for x, y in loader:          # doctest: +SKIP
    ...     xs.get_sharding_spec(x)  # '{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}'
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import queue
import threading
import weakref
from collections.abc import Iterator, Mapping

import numpy as np
import torch
from torch.utils._pytree import tree_map

from xshard.core import api as core
from xshard.core import divergence, execute, ir, runtime
from xshard.core.backend import DEVICE, DEVICE_TYPE
from xshard.core.dtypes import torch_to_numpy
from xshard.core.tensor import XTensor
from xshard.mesh import Mesh
from xshard.spmd import sharding as sh
from xshard.spmd.api import mark_sharding


@dataclasses.dataclass(frozen=True)
class ShardingSpec:
    """How the tensors of a batch are split over a mesh, for ``MpDeviceLoader``.

    Args:
        mesh: the device mesh.
        partition_spec: one entry per tensor dimension, as in ``mark_sharding``.
        minibatch: each process loads only its own slice of the global batch (dimension 0);
            the global batch is the concatenation of every process's batch. With one process the
            batch is the global batch. The per-process batch size must then divide by the number
            of shards of dimension 0 on this process's devices.

    Example:
        >>> spec = xs.ShardingSpec(mesh, ("data", None))
        >>> spec.can_apply(torch.zeros(8, 4))
        True
    """

    mesh: Mesh
    partition_spec: tuple
    minibatch: bool = False

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(
                f"ShardingSpec needs an xshard.spmd.Mesh, got {type(self.mesh).__name__}; build "
                f"one with xs.Mesh(device_ids, mesh_shape, axis_names).")
        if not isinstance(self.partition_spec, (tuple, list)):
            raise TypeError(
                f"partition_spec must be a tuple with one entry per tensor dimension, got "
                f"{self.partition_spec!r}.")
        object.__setattr__(self, "partition_spec", tuple(self.partition_spec))
        # Validate now (unknown axes, an axis used twice...), not at the first batch.
        self.annotation(len(self.partition_spec))

    def can_apply(self, t: torch.Tensor) -> bool:
        """Whether this spec fits ``t`` (its rank equals the spec's length)."""
        return isinstance(t, torch.Tensor) and t.dim() == len(self.partition_spec)

    def annotation(self, ndim: int) -> sh.Annotation:
        return sh.annotation(self.mesh, self.partition_spec, ndim)

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the devices, sharded by this spec.

        A device tensor is annotated in place (``mark_sharding``) and returned; a CPU tensor is
        copied straight into its shards and the new device tensor returned.
        """
        if isinstance(t, XTensor):
            mark_sharding(t, self.mesh, self.partition_spec)
            return t
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ShardingSpec.apply needs a tensor, got {type(t).__name__}.")
        return _as_tensor(_upload(t, self))


# -- host -> device transfer -------------------------------------------------------------------


class _Pending:
    """A transferred tensor, not yet wrapped (see [Note: why the background thread makes no
    tensors])."""

    __slots__ = ("node", "annotation")

    def __init__(self, node: ir.Node, annotation):
        self.node = node
        self.annotation = annotation


def _upload(t: torch.Tensor, spec: ShardingSpec | None) -> _Pending:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if spec is None:
        return _Pending(execute.upload_node(t), None)
    annotation = spec.annotation(t.dim())
    if spec.minibatch:
        return _Pending(_upload_minibatch(t, spec, annotation), annotation)
    return _Pending(core.upload_annotated(t, annotation), annotation)


def _local_tiles_dim0(annotation: sh.Annotation) -> int:
    """How many distinct blocks of dimension 0 this process's devices hold."""
    local = {runtime.position(d) for d in runtime.local_devices()}
    assignment = annotation.plan.tile_assignment  # (*tile_shape, replicate_factor) of device ids
    return len({pos[0] for pos in np.ndindex(*assignment.shape) if int(assignment[pos]) in local})


def _check_process_blocks(spec: ShardingSpec, annotation: sh.Annotation) -> None:
    """A minibatch's global batch is the processes' batches concatenated in process order: each
    block of dimension 0 must be held by one process's devices, the blocks in process order."""
    owner = np.array([d.process_index for d in runtime.devices()])
    assignment = annotation.plan.tile_assignment  # (*tile_shape, replicate_factor) of positions
    blocks = owner[assignment].reshape(assignment.shape[0], -1)
    layout = (f"the partition spec {spec.partition_spec!r} over mesh axes "
              f"{spec.mesh.axis_names!r} of shape {tuple(spec.mesh.mesh_shape)}, devices "
              f"{spec.mesh.device_ids.tolist()}")
    shared = np.flatnonzero((blocks != blocks[:, :1]).any(axis=1))
    if shared.size:
        i = int(shared[0])
        raise ValueError(
            f"A minibatch ShardingSpec loads each process's own rows of the global batch, but "
            f"block {i} of dimension 0 (of {len(blocks)}) is held by devices of processes "
            f"{sorted(set(blocks[i].tolist()))} under {layout}: the batch dimension is not split "
            f"between processes. Shard dimension 0 over a mesh axis that separates the processes' "
            f"devices (e.g. the first axis of Mesh(np.arange(n), (process_count, ...))), or pass "
            f"minibatch=False and load the whole global batch on every process.")
    order = blocks[:, 0]
    if np.any(np.diff(order) < 0):
        raise ValueError(
            f"A minibatch ShardingSpec makes the global batch the processes' batches in process "
            f"order, but {layout} lays the blocks of dimension 0 on processes {order.tolist()} in "
            f"row order, so rows would follow the mesh's device order instead (and differ from "
            f"another tensor loaded over another mesh). List the mesh's devices so that the "
            f"batch axis runs through the processes in ascending order (process 0's devices "
            f"first), e.g. Mesh(np.arange(n), ...).")


def _upload_minibatch(t: torch.Tensor, spec: ShardingSpec, annotation: sh.Annotation) -> ir.Node:
    if t.dim() == 0:
        raise ValueError("A minibatch ShardingSpec needs tensors with a batch dimension (dim 0).")
    local_tiles = _local_tiles_dim0(annotation)
    per_host = t.shape[0]
    if local_tiles == 0:
        raise RuntimeError(
            f"A minibatch ShardingSpec loads each process's part of the batch onto its own devices, "
            f"but the mesh {spec.mesh.device_ids.tolist()} has none of this process's devices "
            f"(positions {[runtime.position(d) for d in runtime.local_devices()]}). Use a mesh "
            f"that spans every process, or minibatch=False.")
    if per_host % local_tiles:
        raise RuntimeError(
            f"When minibatch is configured, the per-host batch size must be divisible by the local "
            f"runtime device count of the sharded batch dimension: got a per-host batch of "
            f"{per_host} for {local_tiles} local shards of dimension 0 (partition spec "
            f"{spec.partition_spec!r} on mesh axes {spec.mesh.axis_names!r}). Use a batch size "
            f"that is a multiple of {local_tiles}, e.g. drop_last=True in the DataLoader.")
    _check_process_blocks(spec, annotation)
    if runtime.process_count() == 1:
        return core.upload_annotated(t, annotation)
    jax = runtime.jax_module()
    tiles = annotation.plan.tile_shape[0]
    global_shape = (per_host * tiles // local_tiles,) + tuple(t.shape[1:])
    padded = annotation.padded_shape(global_shape)
    if padded != global_shape:
        raise RuntimeError(
            f"A minibatch of global shape {global_shape} does not split evenly over the "
            f"sharding {annotation.hlo_sharding}; pad the trailing dimensions to multiples of "
            f"their shard counts.")
    array = jax.make_array_from_process_local_data(annotation.jax_sharding, torch_to_numpy(t),
                                                   global_shape)
    return ir.data_node(array, global_shape, t.dtype, array.sharding)


def _as_tensor(pending: _Pending) -> XTensor:
    return core.new_tensor(pending.node, pending.annotation)


def _transfer(batch, input_sharding):
    """Uploads every tensor of ``batch``; the structure with ``_Pending`` in place of tensors."""
    if isinstance(input_sharding, Mapping):
        if not isinstance(batch, Mapping):
            keys = sorted(map(str, input_sharding))
            raise ValueError(
                f"input_sharding is a dict of ShardingSpecs (keys {keys}), "
                f"so each batch must be a dict with those keys, but the loader produced a "
                f"{type(batch).__name__}. Pass a single ShardingSpec for non-dict batches.")
        out = {}
        for key, value in batch.items():
            if key not in input_sharding:
                raise KeyError(
                    f"The batch has key {key!r}, which input_sharding does not list; available "
                    f"keys: {sorted(map(str, input_sharding))}. Add an entry for it (None to "
                    f"replicate it).")
            out[key] = _transfer(value, input_sharding[key])
        if type(batch) is dict:
            return out
        rebuilt = copy.copy(batch)  # its own type, a defaultdict's factory kept
        rebuilt.update(out)
        return rebuilt

    def upload(t):
        applies = input_sharding is not None and input_sharding.can_apply(t)
        return _upload(t, input_sharding if applies else None)

    return _map_leaves(batch, torch.Tensor, upload)


def _materialize(batch):
    """Wraps the transferred data of a batch as xshard tensors (in the consumer's thread)."""
    return _map_leaves(batch, _Pending, _as_tensor)


def _map_leaves(tree, kind, fn):
    """``tree`` with ``fn`` applied to its leaves of type ``kind`` (PyTorch's pytree; a
    ``UserDict``, such as a tokenizer's ``BatchEncoding``, is copied with its new values, keeping
    its type and attributes; another mapping pytree does not know becomes a dict; a dataclass is
    rebuilt field by field)."""
    def visit(x):
        if isinstance(x, kind):
            return fn(x)
        if isinstance(x, collections.UserDict):
            out = copy.copy(x)
            out.data = {k: _map_leaves(v, kind, fn) for k, v in x.items()}
            return out
        if isinstance(x, Mapping):
            return {k: _map_leaves(v, kind, fn) for k, v in x.items()}
        if _is_dataclass(x):  # field by field, rebuilt with dataclasses.replace
            return dataclasses.replace(x, **{f.name: _map_leaves(getattr(x, f.name), kind, fn)
                                             for f in dataclasses.fields(x) if f.init})
        return x

    return tree_map(visit, tree, is_leaf=lambda x: (isinstance(x, Mapping) and type(x) not in
                                                    _PYTREE_MAPPINGS) or _is_dataclass(x))


def _is_dataclass(x) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


_PYTREE_MAPPINGS = (dict, collections.OrderedDict, collections.defaultdict)


def send_cpu_data_to_device(batch, device=None, input_sharding=None):
    """Copies a batch (tensor, tuple/list or dict of tensors) to the device, sharded.

    Args:
        batch: CPU tensors, possibly in tuples, lists and dicts.
        device: the xshard device (default ``xshard.device()``).
        input_sharding: a ``ShardingSpec`` for every tensor of matching rank (others are
            replicated), or a dict of them keyed like the batch.

    Returns:
        The same structure with xshard tensors.
    """
    _check_device(device)
    _check_sharding(input_sharding)
    return _materialize(_transfer(batch, input_sharding))


def _check_device(device) -> None:
    if device is None:
        return
    if torch.device(device).type != DEVICE_TYPE:
        raise ValueError(
            f"MpDeviceLoader moves batches to the xshard device, got device {device!r}; pass "
            f"xshard.device().")


def _check_sharding(input_sharding) -> None:
    if input_sharding is None or isinstance(input_sharding, ShardingSpec):
        return
    if isinstance(input_sharding, Mapping):
        for key, value in input_sharding.items():
            if value is not None and not isinstance(value, ShardingSpec):
                raise TypeError(
                    f"input_sharding[{key!r}] is a {type(value).__name__}; each value must be a "
                    f"ShardingSpec or None.")
        return
    raise TypeError(
        f"input_sharding must be a ShardingSpec, a dict of them, or None; got "
        f"{type(input_sharding).__name__}.")


# -- the loader ----------------------------------------------------------------------------------


_DONE = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class _Transferred:
    """A batch the thread transferred, and the uploads it made for it."""

    __slots__ = ("batch", "uploads")

    def __init__(self, batch, uploads: list):
        self.batch = batch
        self.uploads = uploads


def _put(q: queue.Queue, stop: threading.Event, item) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _prefetch_worker(source, input_sharding, q: queue.Queue, stop: threading.Event,
                     spill: list) -> None:
    # A plain function, not a method: the thread must not keep the iterator alive, so that an
    # abandoned iterator is collected and its __del__ stops the thread. A batch it took but could
    # not queue before being stopped goes to ``spill``.
    try:
        for batch in source:
            with divergence.collect_uploads() as uploads:
                transferred = _Transferred(_transfer(batch, input_sharding), uploads)
            if not _put(q, stop, transferred):
                spill.append(transferred)
                return
    except BaseException as e:  # handed to the consumer, raised there
        if not _put(q, stop, _Failure(e)):
            spill.append(_Failure(e))
        return
    _put(q, stop, _DONE)


class _Worker:
    """The thread of one pass: it keeps ``prefetch`` transferred batches ready in ``queue``;
    ``leftovers``, batches an earlier pass over the same one-shot source had taken, come first."""

    def __init__(self, loader, input_sharding, prefetch: int, leftovers=()):
        self.one_shot = isinstance(loader, Iterator)
        self.leftovers = collections.deque(leftovers if self.one_shot else ())
        self.queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self.stop = threading.Event()
        self.spill: list = []
        self.thread = threading.Thread(
            target=_prefetch_worker,
            args=(iter(loader), input_sharding, self.queue, self.stop, self.spill),
            name="xshard-MpDeviceLoader", daemon=True)
        self.thread.start()

    def finish(self) -> list:
        """Stops the thread and waits until it has left the source (a new pass may then iterate
        it: a DataLoader's persistent workers, a generator); returns the batches it had taken
        that were not handed out."""
        self.stop.set()
        self.thread.join()
        taken = list(self.leftovers)
        while not self.queue.empty():
            taken.append(self.queue.get_nowait())
        taken += self.spill
        return [item for item in taken if isinstance(item, (_Transferred, _Failure))]


class _PrefetchIterator:
    """Iterates a loader through a ``_Worker``."""

    def __init__(self, worker: _Worker):
        self._worker = worker

    def __iter__(self):
        return self

    def __next__(self):
        worker = self._worker
        if worker.stop.is_set() and not worker.leftovers:
            raise StopIteration
        item = worker.leftovers.popleft() if worker.leftovers else worker.queue.get()
        if item is _DONE:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        divergence.add_uploads(item.uploads)
        return _materialize(item.batch)

    def close(self) -> None:
        """Stops the background thread (it finishes the transfer in progress)."""
        self._worker.stop.set()

    def __del__(self):
        worker = self._worker
        worker.stop.set()
        if not worker.one_shot:  # a re-iterable source starts over: its batches are not kept
            worker.leftovers.clear()
            worker.spill.clear()
            while not worker.queue.empty():
                worker.queue.get_nowait()


# The worker of the last pass over each source (a DataLoader, a generator): a pass left early
# (``break``) may still be inside the source, and must leave it before a new pass starts.
_LAST_PASS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _start_pass(source, input_sharding, prefetch: int) -> _PrefetchIterator:
    """A pass over ``source``. The thread of a pass left early stops first (a DataLoader with
    persistent workers has one iterator, which the new pass resets: the two interleaved lost
    batches or failed); a one-shot source (a generator) goes on where it was, with the batches
    that pass had taken. A pass still in use is left alone: zip(loader, loader)."""
    try:
        last = _LAST_PASS.get(source)
    except TypeError:  # not weakly referable (a list): nothing shared between passes
        last = None
    leftovers = last.finish() if last is not None and last.stop.is_set() else []
    worker = _Worker(source, input_sharding, prefetch, leftovers)
    try:
        _LAST_PASS[source] = worker
    except TypeError:
        pass
    return _PrefetchIterator(worker)


class MpDeviceLoader:
    """Wraps a loader so that its batches arrive on the xshard device, sharded and prefetched.

    Args:
        loader: any iterable of batches: tensors, tuples/lists, dicts or dataclasses of them (e.g.
            a ``torch.utils.data.DataLoader``). Non-tensor leaves pass through unchanged.
        device: ``xshard.device()``.
        input_sharding: a ``ShardingSpec`` applied to every tensor whose rank matches it (others
            are replicated), or a dict of ``ShardingSpec`` (or None, to replicate) keyed like the
            batches, which must then be dicts.
        prefetch: how many batches a background thread transfers ahead of the one in use; 0
            transfers each batch when it is asked for.

    Raises (while iterating):
        ValueError: ``input_sharding`` is a dict but a batch is not.
        KeyError: a batch has a key that ``input_sharding`` does not list.
        RuntimeError: a ``minibatch`` spec and a per-process batch size that does not divide.

    Example:
        >>> loader = xs.MpDeviceLoader(train_loader, xshard.device(),
        ...                            input_sharding=xs.ShardingSpec(mesh, ("data", None)))
        >>> for x, y in loader:  # doctest: +SKIP
        ...     loss = loss_fn(model(x), y); loss.backward(); opt.step(); xshard.sync()
    """

    def __init__(self, loader, device=None, input_sharding=None, prefetch: int = 1):
        _check_device(device)
        _check_sharding(input_sharding)
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ValueError(f"prefetch must be a non-negative int, got {prefetch!r}.")
        self._loader = loader
        self.device = torch.device(device) if device is not None else DEVICE
        self.input_sharding = input_sharding
        self.prefetch = prefetch

    def __iter__(self):
        if self.prefetch == 0:
            return (_materialize(_transfer(batch, self.input_sharding)) for batch in self._loader)
        return _start_pass(self._loader, self.input_sharding, self.prefetch)

    def __len__(self):
        return len(self._loader)


__all__ = ["ShardingSpec", "MpDeviceLoader", "send_cpu_data_to_device"]
