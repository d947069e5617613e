"""The xshard device type: PyTorch's PrivateUse1 key, renamed ``xshard``, with a Python backend.

Registered once, when xshard is imported, before any ``torch.device('xshard')`` exists. torch_xla uses
its own ``XLA`` key, so both can live in one process.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.backend_registration as backend_registration

from xshard.core import execute, rng

DEVICE_TYPE = "xshard"


class _Stream:
    """The xshard device's one stream. Work on it is ordered by the lazy graph and reads wait for
    their values, so a stream only needs to exist for PyTorch code that asks for one (e.g. the
    overlapping loader of ``torch.distributed.checkpoint.FileSystemWriter``)."""

    device_type = DEVICE_TYPE

    def synchronize(self) -> None:
        execute.wait_all()

    def wait_stream(self, stream) -> None:
        pass

    def query(self) -> bool:
        return True


_STREAM = _Stream()


class _DeviceModule:
    """What ``torch.xshard`` answers (PyTorch asks it about seeds, availability and counts).

    ``_initialized`` and ``device()`` are what ``torch.utils.checkpoint`` looks for before it saves
    and restores the device's RNG state around a recomputation (see [Note: the random stream]).
    """

    _initialized = True

    @staticmethod
    def device(index=None):
        """Context manager selecting device ``index``: there is one logical device."""
        return contextlib.nullcontext()

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1  # one logical device; shardings spread its tensors over the physical ones

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False  # seeding never touches the devices, so a forked child may seed freely

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        rng.manual_seed(seed)

    @staticmethod
    def manual_seed(seed: int) -> None:
        rng.manual_seed(seed)

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return rng.get_state()

    @staticmethod
    def set_rng_state(state, device=None) -> None:
        rng.set_state(state)

    @staticmethod
    def initial_seed() -> int:
        return rng.initial_seed()

    @staticmethod
    def synchronize(device=None) -> None:
        execute.sync(wait=True)

    @staticmethod
    def current_stream(device=None) -> _Stream:
        return _STREAM

    @staticmethod
    def stream(stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(stream)

    @staticmethod
    def get_amp_supported_dtype():
        return [torch.float16, torch.bfloat16]


class DeviceRegistrationError(RuntimeError):
    pass


def register_device_type() -> None:
    current = torch._C._get_privateuse1_backend_name()
    if current == DEVICE_TYPE:
        return
    if current != "privateuseone":
        raise DeviceRegistrationError(
            f"PyTorch's PrivateUse1 device is already registered as {current!r} by another "
            f"library in this process; xshard needs it as {DEVICE_TYPE!r}. Import xshard before "
            f"that library, or run them in separate processes.")
    backend_registration._setup_privateuseone_for_python_backend(
        rename=DEVICE_TYPE, backend_module=_DeviceModule())


register_device_type()
DEVICE = torch.device(DEVICE_TYPE, 0)
