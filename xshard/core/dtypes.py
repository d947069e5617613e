"""Dtype mapping between PyTorch and JAX/numpy, and host <-> numpy conversion without loss."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

_TORCH_TO_NUMPY = {
    torch.bool: np.dtype(np.bool_),
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint16: np.dtype(np.uint16),
    torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
}
_NUMPY_TO_TORCH = {v: k for k, v in _TORCH_TO_NUMPY.items()}

# Dtypes numpy cannot hand to torch.from_numpy: carried as same-width integers.
_BITCAST = {
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.int8,
    torch.float8_e5m2: torch.int8,
}


class UnsupportedDtypeError(TypeError):
    pass


def to_numpy_dtype(dtype: torch.dtype) -> np.dtype:
    try:
        return _TORCH_TO_NUMPY[dtype]
    except KeyError:
        raise UnsupportedDtypeError(
            f"dtype {dtype} is not supported on xshard devices; supported: "
            f"{sorted(str(d) for d in _TORCH_TO_NUMPY)}. Convert the tensor first, e.g. t.float()."
        ) from None


def to_torch_dtype(dtype) -> torch.dtype:
    return _NUMPY_TO_TORCH[np.dtype(dtype)]


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy array with the exact values of CPU tensor ``t`` (bfloat16 and fp8 included)."""
    to_numpy_dtype(t.dtype)  # raises UnsupportedDtypeError, naming the supported dtypes
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    carrier = _BITCAST.get(t.dtype)
    if carrier is not None:
        return t.view(carrier).numpy().view(to_numpy_dtype(t.dtype))
    return t.numpy()


def numpy_to_torch(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor owning a copy of ``a``'s values."""
    a = np.asarray(a)
    dtype = to_torch_dtype(a.dtype)
    carrier = _BITCAST.get(dtype)
    if carrier is not None:
        a = a.view(to_numpy_dtype(carrier))
        return torch.from_numpy(np.array(a, copy=True)).view(dtype)
    return torch.from_numpy(np.array(a, copy=True))


_NO_INFINITY = {torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}


def overflows(value, dtype: torch.dtype) -> bool:
    """Whether ATen's checked conversion of Python number ``value`` to ``dtype`` fails (c10's
    ``overflows``): an integer out of range (one for an unsigned dtype may be as low as minus its
    maximum: it wraps), a float out of range or NaN for an integer dtype, a finite float out of a
    floating dtype's range. bool and complex results take any number."""
    if isinstance(value, bool) or dtype is torch.bool or dtype.is_complex:
        return False
    if dtype.is_floating_point:
        if isinstance(value, float) and (math.isnan(value) or (
                math.isinf(value) and dtype not in _NO_INFINITY)):
            return False
        info = torch.finfo(dtype)
        return value < info.min or value > info.max
    info = torch.iinfo(dtype)
    if isinstance(value, float):
        return math.isnan(value) or value < info.min or value > info.max
    if info.min == 0:
        return value > info.max or value < -info.max
    return value < info.min or value > info.max
