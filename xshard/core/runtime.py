"""Which PJRT platform xshard runs on, how many devices it has, and JAX's start-up settings.

This is the one place where xshard reads environment variables, and it reads them once, before JAX
initialises its backends:

- ``PJRT_DEVICE``: ``CPU``, ``CUDA`` (alias ``GPU``) or ``TPU``. Unset: the best platform JAX finds.
- ``XSHARD_CPU_DEVICES``: how many virtual CPU devices the CPU platform exposes (default 1). The tests
  use 8, which gives real sharding, partitioning and collectives on one host.

JAX is configured with 64-bit types enabled, because PyTorch programs use int64 and float64 and their
values must survive (int64 indices beyond 2**31, float64 accumulators). Every lowering rule states its
dtypes explicitly, so this does not widen any float32 computation.
"""

from __future__ import annotations

import functools
import os

_PLATFORMS = {"CPU": "cpu", "CUDA": "cuda", "GPU": "cuda", "TPU": "tpu"}


class RuntimeConfigError(ValueError):
    """An environment variable that configures the runtime has a value xshard cannot use."""


@functools.cache
def _settings() -> tuple[str | None, int]:
    """Reads and validates the environment once: (jax platform name or None, virtual CPU devices)."""
    raw_platform = os.environ.get("PJRT_DEVICE", "").strip()
    platform = None
    if raw_platform:
        platform = _PLATFORMS.get(raw_platform.upper())
        if platform is None:
            raise RuntimeConfigError(
                f"PJRT_DEVICE={raw_platform!r} is not a platform xshard knows. Valid values: "
                f"{sorted(_PLATFORMS)}; unset it to use the best available platform."
            )
    raw_count = os.environ.get("XSHARD_CPU_DEVICES", "1").strip()
    try:
        cpu_devices = int(raw_count)
    except ValueError:
        cpu_devices = 0
    if cpu_devices < 1:
        raise RuntimeConfigError(
            f"XSHARD_CPU_DEVICES={raw_count!r} must be a positive integer (the number of virtual CPU "
            f"devices, e.g. 8)."
        )
    return platform, cpu_devices


@functools.cache
def _jax():
    """Imports and configures JAX exactly once, before any backend initialises."""
    platform, cpu_devices = _settings()
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_num_cpu_devices", cpu_devices)
    if platform is not None:
        jax.config.update("jax_platforms", platform if platform == "cpu" else f"{platform},cpu")
    return jax


def jax_module():
    """The configured ``jax`` module. Use this instead of importing jax before xshard has set it up."""
    return _jax()


@functools.cache
def devices() -> tuple:
    """All devices of the platform in use, across every process, ordered by id.

    Returns:
        A tuple of ``jax.Device``. Mesh device ids index into it.
    """
    jax = _jax()
    return tuple(sorted(jax.devices(), key=lambda d: d.id))


def device_count() -> int:
    """The global number of devices (all processes)."""
    return len(devices())


def local_devices() -> tuple:
    """The devices attached to this process, ordered by id."""
    return tuple(d for d in devices() if d.process_index == process_index())


def process_index() -> int:
    """This process's index in a multi-process run (0 in a single-process run)."""
    return _jax().process_index()


def process_count() -> int:
    """The number of processes in the run (1 unless ``initialize`` joined several)."""
    return _jax().process_count()


def platform() -> str:
    """The platform name of the devices in use: ``'cpu'``, ``'gpu'`` or ``'tpu'``."""
    return devices()[0].platform


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, **kwargs) -> None:
    """Joins a multi-process run through ``jax.distributed.initialize``.

    Call it before any other xshard call that touches devices. On TPU pods and SLURM clusters the
    arguments are discovered automatically and may be omitted.

    Example:
        >>> xshard.initialize("10.0.0.1:1234", num_processes=2, process_id=0)  # doctest: +SKIP
    """
    if devices.cache_info().currsize:
        raise RuntimeError(
            "xshard.initialize() must run before the devices are first used; call it at the top of "
            "the program."
        )
    _jax().distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)
