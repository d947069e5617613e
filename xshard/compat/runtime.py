"""``torch_xla.runtime`` (``xr``) on xshard.

Counts and ordinals in torch_xla's terms (see ``xshard.compat._world``): under ``xmp.spawn``'s
replicas the world size is the number of processes; in one program (SPMD) it is 1, and the
program's devices are counted by ``global_runtime_device_count()``.

Example:
    >>> import torch_xla.runtime as xr
    >>> xr.world_size(), xr.global_ordinal()      # (2, 1) in replica 1 of xmp.spawn(nprocs=2)
    (1, 0)
"""

from __future__ import annotations

import xshard
from xshard.compat import _world
from xshard.compat import xla_model as _xm
from xshard.core import compiler, distributed, runtime


def world_size() -> int:
    """The number of replicas (processes of ``xmp.spawn``); 1 in one program."""
    return _world.world_size()


def global_ordinal() -> int:
    """This replica's ordinal; 0 in one program."""
    return _world.ordinal()


def local_ordinal() -> int:
    """This replica's ordinal among those on its host; 0 in one program."""
    return _world.local_ordinal()


def process_index() -> int:
    """This process's index (``xshard.process_index()``)."""
    return distributed.process_id()


def process_count() -> int:
    """The number of processes (``xshard.process_count()``)."""
    return distributed.num_processes()


host_index = process_index


def local_process_count() -> int:
    """The number of processes on this host (all of them: xmp.spawn starts them on one host)."""
    settings = runtime.distributed_settings()
    if distributed.num_processes() > 1 and settings.local_world_size is not None:
        return settings.local_world_size
    return distributed.num_processes()


def use_spmd(auto: bool = False) -> None:
    """Declares the script one SPMD program over every device: xshard's usual mode, so this only
    records it (``is_spmd()``), and refuses replicas (``xmp.spawn(nprocs>1)``) from then on.

    Args:
        auto: must be False (xshard does not shard automatically; annotate with xshard.spmd).
    """
    if auto:
        raise NotImplementedError("xr.use_spmd(auto=True): automatic sharding is not supported; "
                                  "annotate tensors with xs.mark_sharding (xshard.spmd).")
    if _world.replicas():
        raise RuntimeError(
            "xr.use_spmd() in a process started by xmp.spawn: SPMD is one process over every "
            "device. Run the script without xmp.spawn (or with nprocs=1) to use SPMD.")
    _world.set_spmd()


def is_spmd() -> bool:
    """Whether ``use_spmd()`` was called."""
    return _world.spmd()


def is_bf16_supported() -> bool:
    """True: every platform xshard runs on computes in bfloat16."""
    return True


def _attributes(d) -> dict:
    return {"name": str(d), "platform": d.platform, "device_kind": d.device_kind, "id": d.id,
            "process_index": d.process_index}


def runtime_device_attributes(device=None) -> dict:
    """Attributes of this process's first physical device (``name``, ``platform``,
    ``device_kind``, ``id``, ``process_index``)."""
    return _attributes(runtime.local_devices()[0])


def global_runtime_device_attributes() -> list:
    """``runtime_device_attributes`` of every physical device of the run."""
    return [_attributes(d) for d in runtime.devices()]


def get_num_cached_compilation_graph() -> int:
    """How many programs this process has compiled (xshard's executable cache)."""
    return compiler.cache_size()


def using_pjrt() -> bool:
    """True: xshard runs on PJRT (through JAX)."""
    return True


def device_type() -> str:
    """The platform: ``'CPU'``, ``'CUDA'`` or ``'TPU'``."""
    return _xm.device_type()


def global_runtime_device_count() -> int:
    """Every physical device of the run (all processes)."""
    return runtime.jax_module().device_count() if _world.replicas() else xshard.device_count()


def addressable_runtime_device_count() -> int:
    """The physical devices this process drives."""
    return len(runtime.local_devices())


def global_device_count() -> int:
    """Devices of the run, all processes (as ``global_runtime_device_count``)."""
    return global_runtime_device_count()


def local_device_count() -> int:
    """Devices of this process (as ``addressable_runtime_device_count``)."""
    return addressable_runtime_device_count()


def addressable_device_count() -> int:
    """Devices this process can name: one logical device, ``xshard:0``."""
    return 1


def initialize_cache(path: str, readonly: bool = False) -> None:
    """Keeps compiled programs in ``path`` across runs (JAX's persistent compilation cache).

    Args:
        path: a directory.
        readonly: must be False (JAX's cache reads and writes).
    """
    if readonly:
        raise NotImplementedError("xr.initialize_cache(readonly=True) is not supported: JAX's "
                                  "compilation cache reads and writes; pass readonly=False.")
    jax = runtime.jax_module()
    jax.config.update("jax_compilation_cache_dir", str(path))


_NO_MEANING = {
    "set_device_type": "set PJRT_DEVICE before the process starts (read once at start-up)",
    "using_xrt": "XRT is gone; xshard runs on PJRT",
    "get_master_ip": "the processes of xmp.spawn meet on 127.0.0.1; multi-host runs use "
                     "xshard.initialize()",
}


def __getattr__(name: str):
    if name in _NO_MEANING:
        raise AttributeError(f"torch_xla.runtime.{name} has no counterpart in xshard.compat: "
                             f"{_NO_MEANING[name]}.")
    raise AttributeError(f"module 'torch_xla.runtime' (xshard.compat) has no attribute {name!r}")


__all__ = ["world_size", "global_ordinal", "local_ordinal", "process_index", "process_count",
           "host_index", "local_process_count", "use_spmd", "is_spmd", "using_pjrt",
           "device_type", "global_runtime_device_count", "addressable_runtime_device_count",
           "global_device_count", "local_device_count", "addressable_device_count",
           "initialize_cache", "is_bf16_supported", "runtime_device_attributes",
           "global_runtime_device_attributes", "get_num_cached_compilation_graph"]
