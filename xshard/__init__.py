"""xshard: PyTorch programs on XLA devices, sharded over a mesh.

Quick start:
    >>> import torch, xshard
    >>> dev = xshard.device()
    >>> x = torch.randn(4, 4, device=dev)
    >>> y = (x @ x).relu()
    >>> xshard.sync()          # compiles once, then reuses
    >>> print(y.cpu())         # doctest: +SKIP
"""

from xshard.core import runtime
from xshard.core.runtime import device_count, devices, process_count, process_index  # noqa: F401
from xshard.core.distributed import (InitializationError, initialize,  # noqa: F401
                                     is_main_process, local_device_count)
from xshard.core.divergence import (MultiProcessDivergenceError,  # noqa: F401
                                    MultiProcessTimeoutError)
from xshard.core import device as _device
from xshard.core import attention as _attention  # noqa: F401  (fused SDPA for the device)
from xshard.core import rnn as _rnn  # noqa: F401  (nn.LSTM/GRU/RNN as one scan per layer)
from xshard.core import autocast as _autocast  # noqa: F401  (torch.autocast on the device)
from xshard.core import debug, metrics, rng  # noqa: F401
from xshard.core.barrier import optimization_barrier, optimization_barrier_  # noqa: F401
from xshard.core.execute import compile_only  # noqa: F401
from xshard.core.execute import sync as _sync, wait_all as _wait_all

_device.register()

device = _device.device
__version__ = "0.1.0"


def sync(wait: bool = False) -> None:
    """Runs all pending work as one compiled graph (compiled once, then reused).

    Returns as soon as the work is dispatched; reading a value waits for it.

    Args:
        wait: block until the work has finished (for timing).
    """
    metrics.count(metrics.MARK_STEP)
    _sync(wait=wait)


mark_step = sync


def wait() -> None:
    """Blocks until all dispatched work has finished."""
    _wait_all()


def __getattr__(name: str):
    # xshard.checkpoint imports torch.distributed.checkpoint (seconds): loaded on first use.
    if name == "checkpoint":
        import importlib

        return importlib.import_module("xshard.checkpoint")
    raise AttributeError(f"module 'xshard' has no attribute {name!r}")


def manual_seed(seed: int) -> None:
    """Seeds the device random stream (``torch.manual_seed`` does this too)."""
    rng.manual_seed(seed)


from xshard import memory  # noqa: E402  (per-device memory and FLOPs of a step)
from xshard import profiler  # noqa: E402  (traces: xshard.profiler.start_trace, Trace, StepTrace)
from xshard.step import compile  # noqa: E402,A001  (a whole step traced once: xshard.compile)

__all__ = ["device", "devices", "device_count", "process_index", "process_count", "initialize",
           "local_device_count", "is_main_process", "InitializationError",
           "MultiProcessDivergenceError", "MultiProcessTimeoutError",
           "sync", "mark_step", "wait", "manual_seed", "metrics", "debug", "runtime",
           "optimization_barrier", "optimization_barrier_", "compile_only", "memory", "profiler",
           "compile"]
