"""Global ``jax.Array``s from host data, read back to the host, and copied onto other devices,
without hidden collectives.

In one process these are plain ``jax.device_put`` and ``np.asarray``. With several processes:

- ``put`` (an upload) builds the global array with ``jax.make_array_from_callback``: each process
  copies only the blocks of its own devices from its host copy, and nothing communicates.
  ``jax.device_put`` of host data to a sharding that spans processes would run a cross-process
  equality check (an all-gather, 4-8 ms per upload here, racing any collective another thread runs:
  the prefetching loader deadlocked on it). The equality is checked at the next sync instead, from a
  sampled digest (see ``xshard.core.divergence``).
- ``to_host`` (a read) is local when this process holds the whole value (fully addressable, fully
  replicated, or its shards cover the value); otherwise it gathers the value with a cached jitted
  identity to a replicated layout, which is a collective: it is checked like a sync, and every
  process must make the read.
- ``replicated_on`` and ``replicated_from_local`` rebuild a replicated value on other devices from
  the local replica, where ``jax.device_put`` would be a cross-host reshard (which JAX refuses
  between different device sets); ``moved`` moves any value onto other devices the same way, a
  value sharded over devices of several processes gathered first (a collective, checked like a
  read).
"""

from __future__ import annotations

import functools

import numpy as np

from xshard.core import distributed, divergence, runtime


def put(host: np.ndarray, sharding, label: str | None = None):
    """Copies ``host`` (a private numpy copy: it may be kept, not copied) to the devices, laid out
    by ``sharding``; every process must hold the same ``host`` (checked at the next sync).

    Args:
        host: the whole (global) value.
        sharding: a ``jax.sharding.Sharding``.
        label: what the value is, for the message if processes disagree (default its shape).
    """
    jax = runtime.jax_module()
    if not distributed.ACTIVE:
        return jax.device_put(host, sharding)
    divergence.record_upload(host, label)
    return jax.make_array_from_callback(host.shape, sharding,
                                        lambda index: np.asarray(host[index]))


def to_host(array) -> np.ndarray:
    """The value of ``array`` on the host (collective when no process holds all of it)."""
    if not distributed.ACTIVE or array.is_fully_addressable:
        return np.asarray(array)
    if array.is_fully_replicated:
        return np.asarray(array.addressable_shards[0].data)
    local = _from_local_shards(array)
    if local is not None:
        return local
    gather, digest = _gatherer(array.shape, array.dtype, array.sharding)
    what = (f"a {tuple(array.shape)} {array.dtype} value sharded over devices of processes "
            f"{sorted({d.process_index for d in array.sharding.device_set})}")
    divergence.before_collective(digest, "read", what)
    return np.asarray(gather(array).addressable_shards[0].data)


def _from_local_shards(array) -> np.ndarray | None:
    """The value assembled from this process's shards, or None when they do not cover it."""
    blocks = {}
    for shard in array.addressable_shards:
        key = tuple((s.start, s.stop) for s in shard.index)
        if key not in blocks:
            blocks[key] = shard
    size = int(np.prod(array.shape))
    covered = sum(int(np.prod([(stop if stop is not None else n) - (start or 0)
                               for (start, stop), n in zip(key, array.shape)]))
                  for key in blocks)
    if covered != size:
        return None
    out = np.empty(array.shape, array.dtype)
    for shard in blocks.values():
        out[shard.index] = np.asarray(shard.data)
    return out


@functools.lru_cache(maxsize=256)
def _gatherer(shape, dtype, sharding):
    """A compiled identity from ``sharding`` to replicated on the same devices, and its digest."""
    jax = runtime.jax_module()
    target = _replicated(tuple(sharding._device_assignment))
    aval = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    def xshard_gather(x):  # the program's name in profiles
        return x

    lowered = jax.jit(xshard_gather, out_shardings=target).lower(aval)
    return lowered.compile(), divergence.lowered_digest(lowered)


@functools.lru_cache(maxsize=64)
def _replicated(devices: tuple):
    """Replicated over ``devices`` in their order (a sharding's device assignment: a program's
    input and output shardings must list their devices in one order)."""
    jax = runtime.jax_module()
    mesh = jax.sharding.Mesh(np.array(devices, dtype=object), ("xshard_gather",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def replicated_on(array, sharding):
    """``array`` (replicated) as a replicated value laid out by ``sharding`` on other devices."""
    jax = runtime.jax_module()
    if not distributed.ACTIVE:
        return jax.device_put(array, sharding)
    return replicated_from_local(array, sharding)


def replicated_from_local(array, sharding):
    """A replicated value laid out by ``sharding`` from the local replica of ``array`` (every
    process holds the same value: it ran the same, checked, program)."""
    jax = runtime.jax_module()
    if not distributed.ACTIVE:
        return jax.device_put(array, sharding)
    targets = list(sharding.addressable_devices_indices_map(array.shape))
    if not targets:
        raise ValueError(
            f"xshard cannot lay out a {tuple(array.shape)} value on devices of processes "
            f"{_processes(sharding)} only: process {runtime.process_index()} holds none of them, "
            f"so it would hold no part of the value to compute with or read. In a multi-process "
            f"run every process runs the same script: use a mesh that includes devices of every "
            f"process.")
    if not array.addressable_shards:
        raise ValueError(
            f"xshard cannot copy a {tuple(array.shape)} value held only by devices of processes "
            f"{_processes(array.sharding)} onto devices of process {runtime.process_index()}: "
            f"there is no transfer between processes outside a program. Lay it out over a mesh "
            f"that includes this process's devices first (xs.mark_sharding), or compute it "
            f"there.")
    local = array.addressable_shards[0].data
    pieces = [jax.device_put(local, d) for d in targets]
    return jax.make_array_from_single_device_arrays(array.shape, sharding, pieces)


def moved(array, sharding):
    """``array`` laid out by ``sharding`` over any devices. In one process, or between layouts over
    the same devices, ``jax.device_put``. Across processes onto other devices: a value sharded over
    devices of several processes is gathered to a replica first (a collective among its devices,
    checked like a read), then rebuilt from the local replica on the new devices, then laid out."""
    jax = runtime.jax_module()
    if not distributed.ACTIVE or array.sharding.device_set == sharding.device_set or (
            array.is_fully_addressable and sharding.is_fully_addressable):
        return jax.device_put(array, sharding)
    if not array.is_fully_replicated:
        gather, digest = _gatherer(array.shape, array.dtype, array.sharding)
        divergence.before_collective(
            digest, "move", f"a {tuple(array.shape)} {array.dtype} value sharded over devices of "
                            f"processes {_processes(array.sharding)}")
        array = gather(array)
    replica = replicated_from_local(array, _replicated(tuple(sharding._device_assignment)))
    return jax.device_put(replica, sharding)


def _processes(sharding) -> list:
    return sorted({d.process_index for d in sharding.device_set})


__all__ = ["put", "to_host", "replicated_on", "replicated_from_local", "moved"]
