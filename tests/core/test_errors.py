"""User errors raise clear exceptions that name the problem and the fix."""

import pytest
import torch
import torch.nn as nn

import xshard
from core_testing import DEV, assert_same
from xshard.core.record import DeviceMismatchError


def test_mixing_with_non_scalar_cpu_tensor_names_both_devices():
    d = torch.ones(3, device=DEV)
    c = torch.ones(3)
    for fn in (lambda: d + c, lambda: c * d, lambda: torch.matmul(d, c),
               lambda: torch.cat([d, c]), lambda: torch.where(d > 0, d, c)):
        with pytest.raises(RuntimeError, match=r"xshard:0.*cpu|cpu.*xshard:0"):
            fn()
    with pytest.raises(DeviceMismatchError, match=r"t\.to\(xshard\.device\(\)\)"):
        d + c


def test_module_on_device_with_cpu_input():
    layer = nn.Linear(3, 2).to(DEV)
    with pytest.raises(RuntimeError, match="xshard:0.*cpu|cpu.*xshard:0"):
        layer(torch.randn(4, 3))


def test_zero_dim_cpu_tensors_are_allowed():
    d = torch.arange(4.0, device=DEV)
    s = torch.tensor(2.5)
    assert_same(d * s, torch.arange(4.0) * 2.5)
    assert_same(s + d, torch.arange(4.0) + 2.5)
    assert_same(d.clamp(max=torch.tensor(2.0)), torch.arange(4.0).clamp(max=2.0))
    i = torch.tensor(3)
    assert_same(d[i], torch.tensor(3.0))


def test_inplace_into_cpu_tensor_from_device_raises():
    c = torch.zeros(3)
    with pytest.raises(RuntimeError, match="xshard|device"):
        c.add_(torch.ones(3, device=DEV))


def test_shape_errors_match_eager():
    a, b = torch.ones(2, 3, device=DEV), torch.ones(4, 5, device=DEV)
    with pytest.raises(RuntimeError, match="cannot be multiplied|same reduction dim"):
        a @ b
    with pytest.raises(RuntimeError, match="must match the size|broadcast"):
        a + torch.ones(4, device=DEV)
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        a.view(4, 2)
    with pytest.raises(IndexError, match="out of range"):
        a.sum(dim=5)


def test_generator_argument_rejected():
    with pytest.raises(TypeError, match="torch.manual_seed"):
        torch.randn(2, device=DEV, generator=torch.Generator())


def test_numpy_requires_cpu_copy():
    d = torch.ones(2, device=DEV)
    with pytest.raises(TypeError, match="cpu"):
        d.numpy()
    assert d.cpu().numpy().tolist() == [1.0, 1.0]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_unsupported_dtype_message():
    from xshard.core.dtypes import UnsupportedDtypeError

    with pytest.raises(UnsupportedDtypeError, match="not supported on xshard devices; supported:"):
        torch.zeros(2, dtype=torch.complex32).to(DEV)


def test_bad_environment_values_are_reported():
    from xshard.core import runtime

    runtime._settings.cache_clear()
    try:
        import os
        old = os.environ.get("PJRT_DEVICE")
        os.environ["PJRT_DEVICE"] = "QPU"
        with pytest.raises(runtime.RuntimeConfigError, match="PJRT_DEVICE='QPU'.*Valid values"):
            runtime._settings()
    finally:
        if old is None:
            os.environ.pop("PJRT_DEVICE", None)
        else:
            os.environ["PJRT_DEVICE"] = old
        runtime._settings.cache_clear()
    assert xshard.device_count() == 8
