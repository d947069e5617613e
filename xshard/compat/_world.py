"""Who this process is in torch_xla's terms: replicas of ``xmp.spawn``, or one SPMD program.

torch_xla has two modes, and so does xshard.compat:

- **replicas** (``xmp.spawn(fn, nprocs=N)``, N > 1): N processes, one device each, each its own
  xshard world (``xshard.initialize(world="local")``). ``xr.world_size()`` is N and
  ``xr.global_ordinal()`` the process index; ``xm.optimizer_step`` averages gradients across them.
- **one program** (everything else: a plain script, ``nprocs=1``, ``xr.use_spmd()``, a multi-host
  run of ``python -m xshard.launch``): one logical device over every device, as in torch_xla's SPMD
  mode. ``world_size()`` is 1 and ``global_ordinal()`` 0; the partitioner places any collective.
  Writing files and printing is left to process 0 (``is_master``).
"""

from __future__ import annotations

import os

from xshard.core import distributed, runtime


class _Mode:
    spmd = False    # xr.use_spmd() was called


def replicas() -> bool:
    """Whether this process is one of several ``xmp.spawn`` replicas."""
    return runtime.local_world() and distributed.num_processes() > 1


def spmd() -> bool:
    """Whether ``xr.use_spmd()`` was called, or ``XLA_USE_SPMD=1`` set (torch_xla's older way)."""
    return _Mode.spmd or os.environ.get("XLA_USE_SPMD", "").strip() not in ("", "0")


def set_spmd() -> None:
    _Mode.spmd = True


def world_size() -> int:
    """torch_xla's world size: the number of replicas (1 for one program)."""
    return distributed.num_processes() if replicas() else 1


def ordinal() -> int:
    """torch_xla's global ordinal: this replica's index (0 for one program)."""
    return distributed.process_id() if replicas() else 0


def local_ordinal() -> int:
    """This replica's index among the replicas on its host (0 for one program)."""
    if not replicas():
        return 0
    local = runtime.distributed_settings().local_rank
    return distributed.process_id() if local is None else local


def is_master(local: bool) -> bool:
    """Whether this process writes and prints for the run (see the module docstring)."""
    if replicas():
        return (local_ordinal() if local else ordinal()) == 0
    if local:
        return (runtime.distributed_settings().local_rank or 0) == 0 if \
            distributed.num_processes() > 1 else True
    return distributed.is_main_process()
