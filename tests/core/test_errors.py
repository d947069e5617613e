"""User errors raise clear exceptions that name the problem and the fix."""

import copy

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


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("make", [
    lambda h: torch.complex(h, h), lambda h: h.chalf(), lambda h: h.to(torch.complex32),
    lambda h: torch.view_as_complex(h.reshape(2, 2)),
    lambda h: torch.zeros(2, dtype=torch.complex32, device=DEV)],
    ids=["complex", "chalf", "to", "view_as_complex", "factory"])
def test_a_result_of_an_unsupported_dtype_is_refused_at_the_call(make):
    """The call made a complex32 tensor, and the next sync failed to lower it (torch.complex
    with a raw JAX TypeError)."""
    from xshard.core.dtypes import UnsupportedDtypeError

    half = torch.arange(4.0).half().to(DEV)
    with pytest.raises(UnsupportedDtypeError, match="complex32 .*not supported on xshard"):
        make(half)
    assert (half * 2).sum().item() == 12  # the next sync runs


def test_bad_environment_values_are_reported():
    from xshard.core import runtime

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
    assert xshard.device_count() == 8


# -- failing loudly (issue: no silent wrong answers) ------------------------------------------------


def test_wrong_shaped_rule_result_raises_naming_the_op(monkeypatch):
    from xshard.core import lowering, ops

    op = torch.ops.aten.sin.default
    monkeypatch.setitem(lowering.RULES, op, lambda x: x.reshape(-1))  # (2, 3) -> (6,)
    monkeypatch.setattr(ops, "_FACTS", {})
    try:
        x = torch.randn(2, 3).to(DEV)
        with pytest.raises(lowering.LoweringError, match=r"aten\.sin\.default produced shape "
                                                          r"\(6,\), PyTorch expects \(2, 3\)"):
            x.sin().cpu()
    finally:
        ops._FACTS.clear()


def test_failed_step_error_is_what_reading_its_tensors_raises_and_its_inputs_survive(monkeypatch):
    """A tensor whose step failed keeps that step's error; the data it reads is never donated to
    the steps that run after it, so reading it never says "Array has been deleted"."""
    from xshard.core import lowering

    monkeypatch.setitem(lowering.RULES, "test.broken", _broken)
    a = torch.arange(4.0).to(DEV)
    xshard.sync()
    bad = _broken_tensor(a)
    a.add_(1)  # a's old data is now read only by `bad`: a sync may not donate it
    with pytest.raises(lowering.LoweringError, match="boom"):
        xshard.sync()
    for _ in range(2):
        a.add_(1)
        xshard.sync()  # the rest runs, twice
    assert a.cpu().tolist() == [3.0, 4.0, 5.0, 6.0]
    for _ in range(2):
        with pytest.raises(lowering.LoweringError, match="boom"):
            bad.cpu()


def _broken(x):
    raise ValueError("boom")


def _broken_tensor(a):
    from xshard.core import api, ir

    node = ir.Node("test.broken", (api.value(a),), ((ir.slot(0),), ()), (4,), torch.float32)
    return api.new_tensor(node)


def test_whether_an_input_is_held_does_not_split_a_step_into_two_executables():
    """The same step with its old parameter data held elsewhere (not donatable) or not
    (donated) runs one executable: donation is not part of the graph key."""
    from core_testing import counting

    w = torch.randn(64).to(DEV)
    copy = torch.zeros(64).to(DEV)
    xshard.sync()
    with counting() as d:
        for held in (False, True, False, True):
            if held:
                copy.copy_(w)  # `copy` now holds the very data `w` holds
            w.mul_(0.5).add_(1.0)
            xshard.sync()
        expected = w.cpu()
    assert d["compiles"] == 1
    torch.testing.assert_close(copy.cpu() * 0.5 + 1.0, expected)


def test_in_place_checks_hold_after_the_functional_form_of_the_same_call():
    """``x + y`` broadcasts to (3,); ``x.add_(y)`` cannot (x has shape (1,)): recording the
    first must not let the second skip PyTorch's in-place check."""
    x, y = torch.zeros(1).to(DEV), torch.ones(3).to(DEV)
    assert tuple(torch.add(x, y).shape) == (3,)
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        x.add_(y)
    assert x.cpu().tolist() == [0.0]


def test_make_fx_over_xshard_tensors_is_refused():
    """make_fx's proxy mode hands xshard tensors to xshard, whose lazy recording it cannot see: the
    traced graph returned the tracing call's values whatever its inputs (torch.func.linearize
    gave zero tangents). It is refused, naming the op."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from xshard.core.tensor import TracingError

    x = torch.randn(2, 3).to(xshard.device())
    with pytest.raises(TracingError, match="aten.mul.Tensor on an xshard tensor inside make_fx"):
        make_fx(lambda t: (t * x).sin())(torch.ones(2, 3).to(xshard.device()))
    with pytest.raises(TracingError, match="inside make_fx's proxy mode"):
        torch.func.linearize(lambda a: a * 3, x)
    assert torch.equal((x * 3).cpu(), x.cpu() * 3)  # the lazy path is untouched


def test_nested_tensors_are_refused_naming_the_transformer_fix():
    """nn.TransformerEncoder's inference fast path (eval, no_grad, a padding mask) makes a nested
    tensor, which failed deep inside PyTorch ("NestedTensorImpl doesn't support sizes"); it is
    refused naming the switch, with which the encoder equals eager's."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
    x = torch.randn(2, 3, 4)
    pad = torch.tensor([[False, False, True], [False, False, False]])
    dev = xshard.device()
    fast = torch.nn.TransformerEncoder(copy.deepcopy(layer), 2).eval()
    with torch.no_grad(), pytest.raises(NotImplementedError,
                                        match="nested tensor.*enable_nested_tensor=False"):
        copy.deepcopy(fast).to(dev)(x.to(dev), src_key_padding_mask=pad.to(dev))
    plain = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    with torch.no_grad():
        want = plain(x, src_key_padding_mask=pad)
        got = copy.deepcopy(plain).to(dev)(x.to(dev), src_key_padding_mask=pad.to(dev))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.ConvTranspose1d(4, 5, 3), (1, 8, 3)),
    (lambda: nn.ConvTranspose2d(4, 6, 3, groups=2), (1, 6, 3, 3)),
    (lambda: nn.Conv1d(4, 5, 3), (1, 8, 3)),
    (lambda: nn.Conv2d(4, 6, 3, groups=2), (1, 6, 5, 5)),
])
def test_convolution_with_the_wrong_channels_raises_at_the_call_as_eager(make, shape):
    """A transposed convolution given the wrong number of channels was recorded and failed to
    lower at the next sync (a JAX error); others said "Invalid channel dimensions". Both raise
    eager's message at the call."""
    m, x = make(), torch.randn(shape)
    with pytest.raises(RuntimeError) as eager:
        m(x)
    with pytest.raises(RuntimeError) as ours:
        m.to(DEV)(x.to(DEV))
    assert str(ours.value) == str(eager.value)
