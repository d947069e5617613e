"""Recurrent layers train equal to eager CPU: values and gradients (input, initial states, every
weight) over several SGD steps, one program per layer and direction (a scan), compiled once, no CPU
fallback. nn.LSTM / nn.GRU / nn.RNN (tanh, relu) with layers, directions, batch_first, no bias,
proj_size, packed sequences and dropout; nn.LSTMCell / nn.GRUCell / nn.RNNCell."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import xshard
from core_testing import DEV, assert_same, counting
from xshard.core import rnn as xrnn

TOL = dict(rtol=1e-4, atol=1e-5)
STEPS = 3


def _clone_leaf(t, device):
    return None if t is None else t.detach().clone().to(device).requires_grad_()


def _states(hx, device):
    if hx is None:
        return None
    if isinstance(hx, tuple):
        return tuple(_clone_leaf(h, device) for h in hx)
    return _clone_leaf(hx, device)


def _flat(tree):
    if tree is None:
        return []
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [t for v in tree for t in _flat(v)]


def _step(module, x, hx, device, call, weights):
    """One forward/backward/SGD step; returns (outputs, gradients of inputs, states, weights)."""
    x = _clone_leaf(x, device)
    hx = _states(hx, device)
    outs = _flat(call(module, x, hx))
    loss = sum((o * w.to(device)).sum() for o, w in zip(outs, weights))
    loss.backward()
    grads = [x.grad] + [h.grad for h in _flat(hx)] + [p.grad for p in module.parameters()]
    with torch.no_grad():
        for p in module.parameters():
            p -= 0.1 * p.grad
            p.grad = None
    return [o.detach() for o in outs], grads


def default_call(module, x, hx):
    return module(x) if hx is None else module(x, hx)


def check_trains_like_eager(module, x, hx=None, call=default_call, steps=STEPS):
    """Trains ``module`` on CPU and on xshard for ``steps`` SGD steps from the same weights;
    every step's outputs and gradients must agree, the device steps must compile once and never
    fall back to CPU."""
    torch.manual_seed(0)
    dev_module = copy.deepcopy(module).to(DEV)
    outs = _flat(call(module, x, hx))
    weights = [torch.randn(o.shape) for o in outs]
    with counting() as delta:
        for step in range(steps):
            expected = _step(module, x, hx, "cpu", call, weights)
            with counting() as this_step:
                actual = _step(dev_module, x, hx, DEV, call, weights)
                xshard.sync()
            assert_same(actual, expected, **TOL)
            if step > 0:
                assert this_step["compiles"] == 0, f"step {step} compiled again"
    assert delta["cpu_fallbacks"] == {}
    for p, q in zip(dev_module.parameters(), module.parameters()):
        assert_same(p, q, **TOL)
    return delta


def _recorded_ops(fn):
    """The ops recorded by ``fn`` (names), in the order they reach xshard's dispatcher."""
    from xshard.core import tensor as xt

    seen = []
    inner = xt.dispatch

    def spy(func, args, kwargs):
        seen.append(str(func))
        return inner(func, args, kwargs)

    xt.dispatch = spy
    try:
        fn()
    finally:
        xt.dispatch = inner
    return seen


SEQ, BATCH, FEAT, HID = 5, 3, 4, 6


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN_TANH", "RNN_RELU"])
@pytest.mark.parametrize("layers,bidirectional,batch_first,bias", [
    (1, False, False, True),
    (2, True, True, False),
])
def test_sequence_modules_train_like_eager(kind, layers, bidirectional, batch_first, bias):
    torch.manual_seed(1)
    kw = dict(num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias)
    if kind == "LSTM":
        module = nn.LSTM(FEAT, HID, **kw)
    elif kind == "GRU":
        module = nn.GRU(FEAT, HID, **kw)
    else:
        module = nn.RNN(FEAT, HID, nonlinearity=kind[4:].lower(), **kw)
    x = torch.randn((BATCH, SEQ, FEAT) if batch_first else (SEQ, BATCH, FEAT))
    d = layers * (2 if bidirectional else 1)
    h0 = torch.randn(d, BATCH, HID)
    hx = (h0, torch.randn(d, BATCH, HID)) if kind == "LSTM" else h0
    check_trains_like_eager(module, x, hx)


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_lstm_proj_size_and_default_states():
    torch.manual_seed(2)
    module = nn.LSTM(FEAT, HID, num_layers=2, proj_size=3, bidirectional=True)
    x = torch.randn(SEQ, BATCH, FEAT)
    check_trains_like_eager(module, x)  # zero initial states, made by the module
    hx = (torch.randn(4, BATCH, 3), torch.randn(4, BATCH, HID))
    check_trains_like_eager(module, x, hx)


def test_unbatched_input():
    torch.manual_seed(3)
    check_trains_like_eager(nn.GRU(FEAT, HID, num_layers=2), torch.randn(SEQ, FEAT),
                            torch.randn(2, HID))


@pytest.mark.parametrize("kind,batch_first", [("LSTM", False), ("GRU", True),
                                              ("RNN_TANH", False)])
def test_packed_sequences_train_like_eager(kind, batch_first):
    torch.manual_seed(4)
    cls = {"LSTM": nn.LSTM, "GRU": nn.GRU, "RNN_TANH": nn.RNN}[kind]
    module = cls(FEAT, HID, num_layers=2, bidirectional=True, batch_first=batch_first)
    batch = 4
    lengths = torch.tensor([2, 5, 3, 5])  # unsorted, with a tie and one short sequence
    x = torch.randn((batch, SEQ, FEAT) if batch_first else (SEQ, batch, FEAT))
    h0 = torch.randn(4, batch, HID)
    hx = (h0, torch.randn(4, batch, HID)) if kind == "LSTM" else h0

    def call(m, x, hx):
        packed = pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=False)
        out, h = m(packed, hx)
        padded, out_lengths = pad_packed_sequence(out, batch_first=batch_first)
        assert out_lengths.tolist() == lengths.tolist()
        return padded, h

    check_trains_like_eager(module, x, hx, call)


def test_packed_sequence_data_matches_eager():
    x = torch.randn(SEQ, 3, FEAT)
    lengths = torch.tensor([5, 3, 1])
    expected = pack_padded_sequence(x, lengths)
    actual = pack_padded_sequence(x.to(DEV), lengths)
    assert actual.batch_sizes.device.type == "cpu"
    assert actual.batch_sizes.tolist() == expected.batch_sizes.tolist()
    assert_same(actual.data, expected.data, rtol=0, atol=0)
    with pytest.raises(ValueError, match="sorted in decreasing order"):
        torch._VF._pack_padded_sequence(x.to(DEV), torch.tensor([1, 3, 5]), False)
    with pytest.raises(ValueError, match="1D CPU int64 tensor"):
        torch._VF._pack_padded_sequence(x.to(DEV), lengths.to(DEV), False)


def test_dropout_between_layers_uses_the_device_stream():
    """Dropout between layers: the mask is drawn on the device (so it cannot match CPU's); given
    the same mask, the rest equals eager. The mask is the first draw after seeding, so drawing it
    again with the same seed reproduces it."""
    torch.manual_seed(5)
    p = 0.5
    module = nn.GRU(FEAT, HID, num_layers=2, dropout=p)
    x = torch.randn(SEQ, BATCH, FEAT)
    dev_module = copy.deepcopy(module).to(DEV)
    xshard.manual_seed(7)
    with counting() as delta:
        out, h = dev_module(x.to(DEV))
        out.sum().backward()
        xshard.sync()
    assert delta["cpu_fallbacks"] == {}
    xshard.manual_seed(7)
    mask = F.dropout(torch.ones(SEQ, BATCH, HID, device=DEV), p).cpu()
    assert 0 < (mask == 0).sum() < mask.numel()

    layer0 = nn.GRU(FEAT, HID)
    layer1 = nn.GRU(HID, HID)
    for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        getattr(layer0, f"{name}_l0").data = getattr(module, f"{name}_l0").data
        getattr(layer1, f"{name}_l0").data = getattr(module, f"{name}_l1").data
    y0, h0 = layer0(x)
    y1, h1 = layer1(y0 * mask)
    y1.sum().backward()
    assert_same(out, y1.detach(), **TOL)
    assert_same(h, torch.cat([h0, h1]).detach(), **TOL)
    assert_same(dev_module.weight_ih_l0.grad, layer0.weight_ih_l0.grad, **TOL)
    assert_same(dev_module.weight_hh_l1.grad, layer1.weight_hh_l0.grad, **TOL)
    # eval mode: no dropout, equal to eager
    module.eval()
    dev_module.eval()
    assert_same(dev_module(x.to(DEV))[0], module(x)[0].detach(), **TOL)


@pytest.mark.parametrize("cls,bias", [(nn.LSTMCell, True), (nn.LSTMCell, False),
                                      (nn.GRUCell, True), (nn.GRUCell, False),
                                      (nn.RNNCell, True)])
def test_cells_train_like_eager(cls, bias):
    torch.manual_seed(6)
    module = cls(FEAT, HID, bias=bias)
    x = torch.randn(BATCH, FEAT)
    h = torch.randn(BATCH, HID)
    hx = (h, torch.randn(BATCH, HID)) if cls is nn.LSTMCell else h
    check_trains_like_eager(module, x, hx)


def test_cells_unrolled_over_a_sequence():
    """A hand-written loop over a cell (the common seq2seq decoder form), only h_n used."""
    torch.manual_seed(7)
    module = nn.LSTMCell(FEAT, HID)
    x = torch.randn(SEQ, BATCH, FEAT)

    def call(m, x, hx):
        h = c = torch.zeros(BATCH, HID, device=x.device)
        for t in range(x.shape[0]):
            h, c = m(x[t], (h, c))
        return h

    check_trains_like_eager(module, x, None, call)


def test_one_scan_per_layer_and_direction():
    """The program does not grow with the sequence: one layer op per layer and direction in
    forward and one backward op each, lowered to loops; a steady loop compiles once."""
    module = nn.LSTM(FEAT, HID, num_layers=2, bidirectional=True).to(DEV)

    def step(seq):
        module.zero_grad(set_to_none=True)
        out, _ = module(torch.randn(seq, BATCH, FEAT, device=DEV))
        out.sum().backward()
        return [out] + [p.grad for p in module.parameters()]

    short, long = _recorded_ops(lambda: step(3)), _recorded_ops(lambda: step(40))
    assert short == long
    assert short.count("xshard.rnn_layer.default") == 4
    assert short.count("xshard.rnn_layer_backward.default") == 4
    assert not any("_thnn" in op for op in short)
    hlo_short, hlo_long = xshard.debug.hlo_text(step(3)), xshard.debug.hlo_text(step(40))
    assert hlo_short.count(" while(") == hlo_long.count(" while(") >= 8
    assert len(hlo_long.splitlines()) < 1.05 * len(hlo_short.splitlines())  # not unrolled
    for _ in range(2):  # the first sync also runs what the calls above left pending
        step(40)
        xshard.sync()
    with counting() as delta:
        step(40)
        xshard.sync()
    assert delta["compiles"] == 0 and delta["executions"] == 1


def test_inference_mode_runs_the_scans():
    """Under torch.inference_mode the composite reaches the recorder itself; it runs the scans."""
    torch.manual_seed(8)
    module = nn.LSTM(FEAT, HID, num_layers=2, bidirectional=True)
    x = torch.randn(SEQ, BATCH, FEAT)
    dev_module = copy.deepcopy(module).to(DEV)
    with torch.inference_mode():
        ops = _recorded_ops(lambda: dev_module(x.to(DEV)))
        out, (h, c) = dev_module(x.to(DEV))
    assert ops.count("xshard.rnn_layer.default") == 4 and not any("_thnn" in op for op in ops)
    assert_same([out, h, c], [t.detach() for t in _flat(module(x))], **TOL)


def test_bad_arguments_raise_clear_errors():
    x = torch.randn(SEQ, BATCH, FEAT, device=DEV)
    module = nn.LSTM(FEAT, HID).to(DEV)
    params = list(module._flat_weights)
    h = torch.zeros(1, BATCH, HID, device=DEV)
    with pytest.raises(ValueError, match="parameter tensors for num_layers=2"):
        torch._VF.lstm(x, (h, h), params, True, 2, 0.0, True, False, False)
    with pytest.raises(ValueError, match="hx\\[1\\] has dtype torch.float64"):
        torch._VF.lstm(x, (h, h.double()), params, True, 1, 0.0, True, False, False)
    with pytest.raises(ValueError, match=r"hx\[1\] has shape \(1, 2, 6\), expected \(1, 3, 6\)"):
        torch._VF.lstm(x, (h, h[:, :2]), params, True, 1, 0.0, True, False, False)
    with pytest.raises(ValueError, match="input has 5 features but params\\[0\\]"):
        torch._VF.lstm(torch.randn(SEQ, BATCH, 5, device=DEV), (h, h), params, True, 1, 0.0,
                       True, False, False)
    with pytest.raises(ValueError, match="input must have 3 dimensions"):
        torch._VF.lstm(x[0], (h, h), params, True, 1, 0.0, True, False, False)
    with pytest.raises(ValueError, match="batch_sizes \\[3, 4\\] must be positive, non-increasing"):
        torch._VF.lstm(x[0].repeat(7, 1)[:7], torch.tensor([3, 4]), (h, h), params, True, 1, 0.0,
                       True, False)
    assert isinstance(xrnn.RNNArgumentError("x"), ValueError)


def test_double_backward_is_refused():
    module = nn.GRU(FEAT, HID).to(DEV)
    x = torch.randn(SEQ, BATCH, FEAT, device=DEV, requires_grad=True)
    out, _ = module(x)
    v = torch.ones(out.shape, device=DEV, requires_grad=True)
    (g,) = torch.autograd.grad(out, x, v, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice a function that was marked with "
                                           "@once_differentiable"):
        g.sum().backward()
