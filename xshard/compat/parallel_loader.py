"""``torch_xla.distributed.parallel_loader`` (``pl``) on xshard.

``ParallelLoader(loader, [device]).per_device_loader(device)`` and ``MpDeviceLoader(loader,
device)`` hand out ``loader``'s batches on the xshard device, copied ahead by a background thread
(``xshard.spmd.MpDeviceLoader``), with torch_xla's semantics: **before handing out each batch they
end the step** (``xm.mark_step()``: the pending work runs as one program, then the step closures),
and once more when the data runs out, so a loop that never calls ``mark_step`` still runs one
program per batch. ``len`` is the wrapped loader's.

Example:
    >>> para_loader = pl.ParallelLoader(train_loader, [device])
    >>> for x, y in para_loader.per_device_loader(device):      # doctest: +SKIP
    ...     loss = loss_fn(model(x), y); loss.backward(); xm.optimizer_step(optimizer)
"""

from __future__ import annotations

import torch

import xshard
import xshard.spmd as xs
from xshard.compat import xla_model as xm


def _positive_int(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return value


def _is_this_device(device: torch.device) -> bool:
    return device.type == xshard.device().type and device.index in (None, 0)


def _the_device(devices) -> torch.device:
    devices = list(devices) if isinstance(devices, (list, tuple)) else [devices]
    if len(devices) != 1:
        raise ValueError(
            f"ParallelLoader(devices={devices!r}): xshard has one device per process, so pass "
            f"[xm.xla_device()]. Replicas are processes (xmp.spawn), each with its own loader; to "
            f"split one batch over several devices, use input_sharding=xs.ShardingSpec(mesh, "
            f"('data', None, ...)).")
    device = torch.device(devices[0])
    if not _is_this_device(device):
        raise ValueError(f"ParallelLoader: {devices[0]!r} is not this process's device; pass "
                         f"[xm.xla_device()] ({xshard.device()}).")
    return xshard.device()


class PerDeviceLoader:
    """The batches of a ``ParallelLoader`` on its device; iterates once (as torch_xla's does).

    Each ``next()`` first ends the step (every ``batches_per_execution`` batches), and ends it
    once more when the data runs out.
    """

    def __init__(self, parallel_loader: "ParallelLoader", device):
        self._parallel = parallel_loader
        self._device = device
        self._since_sync = parallel_loader.batches_per_execution  # sync before the first batch
        self._exhausted = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._exhausted:
            raise StopIteration
        if self._since_sync >= self._parallel.batches_per_execution:
            self._since_sync = 0
            xm.mark_step()
        self._since_sync += 1
        try:
            return next(self._parallel._batches)
        except StopIteration:
            self._exhausted = True
            xm.mark_step()
            raise

    next = __next__

    def __len__(self) -> int:
        return self._parallel.per_device_samples()


class ParallelLoader:
    """Wraps a CPU loader; its batches are copied to the device ahead of use, from now on.

    Args:
        cpu_loader: any iterable of batches (tensors, tuples/lists or dicts of them), e.g. a
            ``DataLoader`` with a ``DistributedSampler(num_replicas=xm.xrt_world_size(),
            rank=xm.get_ordinal())``.
        devices: ``[xm.xla_device()]``.
        batchdim: accepted (one device: batches are not split).
        batches_per_execution: batches between the steps the loader ends.
        loader_prefetch_size, host_to_device_transfer_threads: accepted (one thread copies).
        device_prefetch_size: batches copied ahead of the one in use.
        input_sharding: an ``xs.ShardingSpec`` for the batches (one SPMD program).

    Example:
        >>> loader = pl.ParallelLoader(train_loader, [device]).per_device_loader(device)
    """

    def __init__(self, cpu_loader, devices, batchdim: int = 0, batches_per_execution: int = 1,
                 loader_prefetch_size: int = 16, device_prefetch_size: int = 8,
                 host_to_device_transfer_threads: int = 1, input_sharding=None):
        self._device = _the_device(devices)
        self.batches_per_execution = _positive_int(batches_per_execution,
                                                   "batches_per_execution")
        _positive_int(loader_prefetch_size, "loader_prefetch_size")
        _positive_int(host_to_device_transfer_threads, "host_to_device_transfer_threads")
        if not isinstance(device_prefetch_size, int) or device_prefetch_size < 0:
            raise ValueError(f"device_prefetch_size must be a non-negative int, got "
                             f"{device_prefetch_size!r}.")
        self._loader = cpu_loader
        # As torch_xla's, the loader starts now: a sampler's set_epoch must come before.
        self._batches = iter(xs.MpDeviceLoader(cpu_loader, self._device,
                                               input_sharding=input_sharding,
                                               prefetch=device_prefetch_size))

    def per_device_loader(self, device) -> PerDeviceLoader:
        """The loader of ``device`` (``xm.xla_device()``)."""
        if not _is_this_device(torch.device(device)):
            raise ValueError(f"per_device_loader({device!r}): this ParallelLoader feeds "
                             f"{self._device}; pass xm.xla_device().")
        return PerDeviceLoader(self, self._device)

    def per_device_samples(self) -> int:
        """Batches per device: ``len(cpu_loader)``."""
        return len(self._loader)

    def close(self) -> None:
        """Stops the background copies."""
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()


class MpDeviceLoader:
    """A loader whose every pass is a fresh ``ParallelLoader(loader, [device], **kwargs)``'s
    per-device loader: batches on the device, the step ended before each.

    Example:
        >>> train_device_loader = pl.MpDeviceLoader(train_loader, device)
        >>> for x, y in train_device_loader:       # doctest: +SKIP
        ...     ...
    """

    def __init__(self, loader, device, **kwargs):
        self._device = _the_device([device])
        self._loader = loader
        self._kwargs = kwargs

    def __iter__(self) -> PerDeviceLoader:
        return ParallelLoader(self._loader, [self._device],
                              **self._kwargs).per_device_loader(self._device)

    def __len__(self) -> int:
        return len(self._loader)


__all__ = ["ParallelLoader", "PerDeviceLoader", "MpDeviceLoader"]
