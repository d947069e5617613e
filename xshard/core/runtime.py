"""Which PJRT platform xshard runs on, how many devices it has, and JAX's start-up settings.

This is the one place where xshard reads environment variables, before JAX initialises its
backends (see [Note: when the environment is read]):

- ``PJRT_DEVICE``: ``CPU``, ``CUDA`` (alias ``GPU``) or ``TPU``. Unset: the best platform JAX finds.
- ``XSHARD_CPU_DEVICES``: how many virtual CPU devices the CPU platform exposes (default 1). The tests
  use 8, which gives real sharding, partitioning and collectives on one host. torch_xla's
  ``CPU_NUM_DEVICES`` is read when it is unset.
- Multi-process runs (read by ``distributed_settings()``, used by ``xshard.initialize()``):
  ``XSHARD_COORDINATOR_ADDRESS``, ``XSHARD_NUM_PROCESSES``, ``XSHARD_PROCESS_ID`` (set by
  ``python -m xshard.launch``); torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE``;
  ``XSHARD_INIT_TIMEOUT`` (s, default 300), ``XSHARD_HEARTBEAT_TIMEOUT`` (s, default 60),
  ``XSHARD_SHUTDOWN_TIMEOUT`` (s, default 60), ``XSHARD_SYNC_TIMEOUT`` (s a process waits for the
  others at a sync before it raises, default 600), ``XSHARD_CHECK`` (``always``: compare every
  program across processes before it runs, the default; ``off``); and whether a SLURM, Open MPI or
  Cloud TPU environment is present (for JAX's cluster detection).
- ``XSHARD_DEBUG``: ``1`` prints, for every graph xshard runs, whether it was compiled or came from the
  cache, what triggered it (the user's line) and, for a compile, why (what differs from the nearest
  cached graph); ``0`` or unset: off. See ``xshard.core.trace``.
- ``XSHARD_CACHE_SIZE``: how many compiled programs the executable cache keeps, the least recently
  used dropped beyond it (default 1024; ``0``: no limit). See ``cache_limit()``.

JAX is configured with 64-bit types enabled, because PyTorch programs use int64 and float64 and their
values must survive (int64 indices beyond 2**31, float64 accumulators). Every lowering rule states its
dtypes explicitly, so this does not widen any float32 computation.
"""

from __future__ import annotations

import dataclasses
import functools
import os

_PLATFORMS = {"CPU": "cpu", "CUDA": "cuda", "GPU": "cuda", "TPU": "tpu"}


class RuntimeConfigError(ValueError):
    """An environment variable that configures the runtime has a value xshard cannot use."""


def _settings() -> tuple[str | None, int]:
    """Reads and validates the environment: (jax platform name or None, virtual CPU devices)."""
    raw_platform = os.environ.get("PJRT_DEVICE", "").strip()
    platform = None
    if raw_platform:
        platform = _PLATFORMS.get(raw_platform.upper())
        if platform is None:
            raise RuntimeConfigError(
                f"PJRT_DEVICE={raw_platform!r} is not a platform xshard knows. Valid values: "
                f"{sorted(_PLATFORMS)}; unset it to use the best available platform."
            )
    # torch_xla's CPU_NUM_DEVICES means the same; xshard's own name wins.
    name = "XSHARD_CPU_DEVICES" if os.environ.get("XSHARD_CPU_DEVICES", "").strip() or \
        not os.environ.get("CPU_NUM_DEVICES", "").strip() else "CPU_NUM_DEVICES"
    raw_count = os.environ.get(name, "1").strip() or "1"
    try:
        cpu_devices = int(raw_count)
    except ValueError:
        cpu_devices = 0
    if cpu_devices < 1:
        raise RuntimeConfigError(
            f"{name}={raw_count!r} must be a positive integer (the number of virtual CPU "
            f"devices, e.g. 8)."
        )
    return platform, cpu_devices


def configured_platform() -> tuple[str | None, int]:
    """What the environment asks for, read without starting JAX's backends: the JAX platform
    named by ``PJRT_DEVICE`` (``'cpu'``, ``'cuda'``, ``'tpu'``; None: the best available) and the
    number of virtual CPU devices."""
    return _settings()


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """The multi-process configuration found in the environment (see the module docstring)."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    agent_store: bool = False
    init_timeout: float = 300.0
    heartbeat_timeout: float = 60.0
    shutdown_timeout: float = 60.0
    sync_timeout: float = 600.0
    check: str = "always"
    cluster: str | None = None


_CHECK_MODES = ("always", "off")


def _env_int(name: str, minimum: int) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise RuntimeConfigError(f"{name}={raw!r} must be an integer >= {minimum}.")
    return value


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise RuntimeConfigError(f"{name}={raw!r} must be a positive number of seconds, e.g. 30.")
    return value


def _cluster() -> str | None:
    """Which cluster environment JAX's detection would find, judged from the environment only."""
    env = os.environ
    if all(v in env for v in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")) and \
            env.get("SLURM_NTASKS", "1").strip() not in ("", "0", "1"):
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env or "OMPI_COMM_WORLD_SIZE" in env:
        return "ompi"
    if "TPU_WORKER_HOSTNAMES" in env or "TPU_PROCESS_ADDRESSES" in env or \
            "MEGASCALE_COORDINATOR_ADDRESS" in env or "CLOUD_TPU_TASK_ID" in env:
        return "tpu"
    return None


@functools.cache
def distributed_settings() -> DistributedSettings:
    """Reads and validates the multi-process variables once (see the module docstring)."""
    env = os.environ
    check = env.get("XSHARD_CHECK", "always").strip().lower() or "always"
    if check not in _CHECK_MODES:
        raise RuntimeConfigError(f"XSHARD_CHECK={env.get('XSHARD_CHECK')!r} is not a mode xshard "
                                 f"knows; valid values: {list(_CHECK_MODES)}.")
    return DistributedSettings(
        coordinator_address=env.get("XSHARD_COORDINATOR_ADDRESS", "").strip() or None,
        num_processes=_env_int("XSHARD_NUM_PROCESSES", 1),
        process_id=_env_int("XSHARD_PROCESS_ID", 0),
        rank=_env_int("RANK", 0),
        world_size=_env_int("WORLD_SIZE", 1),
        local_rank=_env_int("LOCAL_RANK", 0),
        local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
        master_addr=env.get("MASTER_ADDR", "").strip() or None,
        master_port=_env_int("MASTER_PORT", 1),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true",
        init_timeout=_env_seconds("XSHARD_INIT_TIMEOUT", 300.0),
        heartbeat_timeout=_env_seconds("XSHARD_HEARTBEAT_TIMEOUT", 60.0),
        shutdown_timeout=_env_seconds("XSHARD_SHUTDOWN_TIMEOUT", 60.0),
        sync_timeout=_env_seconds("XSHARD_SYNC_TIMEOUT", 600.0),
        check=check,
        cluster=_cluster(),
    )


DEFAULT_CACHE_SIZE = 1024


@functools.cache
def cache_limit() -> int | None:
    """How many compiled programs xshard keeps (``XSHARD_CACHE_SIZE``, read once; None: no limit).
    Each holds its machine code in memory mappings of its own: with no limit, a process compiling
    tens of thousands of distinct graphs (a shape that changes every step) ran out of the kernel's
    mappings and XLA's compiler failed ("Cannot allocate memory")."""
    n = _env_int("XSHARD_CACHE_SIZE", 0)
    if n is None:
        return DEFAULT_CACHE_SIZE
    return n or None


@functools.cache
def debug_enabled() -> bool:
    """Whether ``XSHARD_DEBUG`` asks for per-step compile reports (read once)."""
    raw = os.environ.get("XSHARD_DEBUG", "").strip()
    if raw not in ("", "0", "1"):
        raise RuntimeConfigError(
            f"XSHARD_DEBUG={raw!r} must be 1 (print, for every graph run, whether it compiled and "
            f"why) or 0 (off); unset means 0.")
    return raw == "1"


# [Note: when the environment is read]
# JAX is imported and configured when xshard is imported (the lowering rules need the module), and
# PJRT_DEVICE / XSHARD_CPU_DEVICES are read then. They are read again when xshard first uses the
# devices, and JAX's configuration follows any change made in between: a script run by
# ``python -m xshard.compat``, which imports xshard before the script's first line, may still set
# ``os.environ["PJRT_DEVICE"]`` at its top, as torch_xla (which reads it at first use) allows.
_APPLIED: dict = {}


def _configure(jax) -> None:
    """Puts the environment's platform and CPU device count into JAX's configuration."""
    settings = _settings()
    if settings == _APPLIED.get("settings"):
        return
    platform, cpu_devices = settings
    try:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
        if platform is not None:
            jax.config.update("jax_platforms",
                              platform if platform == "cpu" else f"{platform},cpu")
    except Exception as error:  # noqa: BLE001  (JAX refuses once its backends have started)
        local = jax.local_devices()
        running = local[0].platform
        if platform in (None, running) and (running != "cpu" or cpu_devices == len(local)):
            _APPLIED["settings"] = settings  # what is asked is what runs
            return
        asked = ", ".join(f"{name}={os.environ.get(name)!r}"
                          for name in ("PJRT_DEVICE", "XSHARD_CPU_DEVICES"))
        raise RuntimeConfigError(
            f"The environment asks for {asked}, but JAX started its backends before it was set "
            f"and runs {len(local)} {running} device(s) here. Set these variables before the "
            f"program first uses a device (or in the process's environment: "
            f"PJRT_DEVICE=... python script.py). JAX said: {error}") from None
    _APPLIED["settings"] = settings


@functools.cache
def _jax():
    """Imports and configures JAX exactly once, before any backend initialises."""
    import jax

    jax.config.update("jax_enable_x64", True)
    _configure(jax)
    return jax


def jax_module():
    """The configured ``jax`` module. Use this instead of importing jax before xshard has set it up."""
    return _jax()


# [Note: the local world]
# By default xshard's world is every device of every process: one SPMD program spans them all.
# xshard.compat's replica processes (xmp.spawn) are instead each a world of their own, as in
# PyTorch/XLA's multi-process mode: a process's tensors live on its local devices only, its programs
# run without the other processes, and the processes meet only in explicit collectives (built over
# jax.devices(), which still lists every process's devices). ``use_local_world()`` chooses this
# before the devices are first used (``xshard.initialize(world="local")`` calls it).
_LOCAL_WORLD = {"on": False}


def use_local_world() -> None:
    """Makes this process's local devices the whole of xshard's world (see [Note: the local
    world]). Call before the devices are first used."""
    if devices.cache_info().currsize and not _LOCAL_WORLD["on"]:
        raise RuntimeError("the local world must be chosen before the devices are first used; "
                           "call xshard.initialize(world='local') at the top of the program.")
    _LOCAL_WORLD["on"] = True


def local_world() -> bool:
    """Whether xshard's world is this process's local devices only (see [Note: the local
    world])."""
    return _LOCAL_WORLD["on"]


@functools.cache
def devices() -> tuple:
    """All devices of the platform in use, across every process, ordered by id (in the local
    world: this process's devices only).

    Returns:
        A tuple of ``jax.Device``. Mesh device ids index into it.
    """
    jax = _jax()
    _configure(jax)  # see [Note: when the environment is read]
    found = jax.local_devices() if _LOCAL_WORLD["on"] else jax.devices()
    return tuple(sorted(found, key=lambda d: d.id))


@functools.cache
def _positions() -> dict:
    return {d.id: i for i, d in enumerate(devices())}


def position(device) -> int:
    """The position of ``device`` in ``devices()``: the device id meshes, sharding strings and
    shard names use. In a multi-process run JAX's own ids are not positions (the devices of process
    1 have ids 2048, 2049, ... on CPU); everything users see is numbered by position.
    """
    return _positions()[device.id]


def device_count() -> int:
    """The global number of devices (all processes)."""
    return len(devices())


def local_devices() -> tuple:
    """The devices attached to this process, ordered by id."""
    return tuple(d for d in devices() if d.process_index == process_index())


def process_index() -> int:
    """This process's index in a multi-process run (0 in a single-process run)."""
    devices()  # starts the backends as configured
    return _jax().process_index()


def process_count() -> int:
    """The number of processes in the run (1 unless ``initialize`` joined several)."""
    devices()
    return _jax().process_count()


def platform() -> str:
    """The platform name of the devices in use: ``'cpu'``, ``'gpu'`` or ``'tpu'``."""
    return devices()[0].platform
