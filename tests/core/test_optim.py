"""torch.optim unchanged on xshard: SGD (momentum), Adam, AdamW in foreach and for-loop form, and the
fused optimizers, equal to eager over several steps; state_dict/load_state_dict of models and
optimizers."""

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xshard
from core_testing import DEV, assert_same, counting

TOL = dict(rtol=1e-4, atol=1e-5)

OPTIMIZERS = {
    "sgd": lambda p, fe: torch.optim.SGD(p, lr=0.1, foreach=fe),
    "sgd_momentum": lambda p, fe: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                                  weight_decay=1e-2, foreach=fe),
    "adam": lambda p, fe: torch.optim.Adam(p, lr=1e-2, foreach=fe),
    "adam_amsgrad": lambda p, fe: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=0.1,
                                                   foreach=fe),
    "adamw": lambda p, fe: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=fe),
}


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 3))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n)]


def train(model, opt, data, device, sync=False):
    losses = []
    for x, y in data:
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sync:
            xshard.sync()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("foreach", [None, False], ids=["foreach", "for_loop"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_matches_eager(name, foreach):
    data = batches(4)
    ref = make_model()
    ref_opt = OPTIMIZERS[name](ref.parameters(), foreach)
    ref_losses = train(ref, ref_opt, data, "cpu")

    model = make_model().to(DEV)
    opt = OPTIMIZERS[name](model.parameters(), foreach)
    with counting() as d:
        losses = train(model, opt, data, DEV, sync=True)
    assert d["cpu_fallbacks"] == {}
    assert d["executions"] == len(data)
    # Step 1 creates the optimizer state, step 2 reads it: at most two programs, then reuse.
    assert d["compiles"] <= 2
    assert_same(losses, ref_losses, **TOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p, q, **TOL)
    for st, ref_st in zip(opt.state.values(), ref_opt.state.values()):
        for k in ref_st:
            if st[k].device.type == "cpu":  # Adam's step count stays on the host, as with CUDA
                assert k == "step" and torch.equal(st[k], ref_st[k])
            else:
                assert_same(st[k], ref_st[k], **TOL)


FUSED = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, fused=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1,
                                              weight_decay=1e-2, fused=True),
    "sgd_nesterov_maximize": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                                       maximize=True, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adam_amsgrad_decay": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=0.1,
                                                     fused=True),
    "adam_tensor_lr_maximize": lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-2),
                                                          maximize=True, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, fused=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, weight_decay=0.1,
                                             fused=True),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_optimizers_match_eager(name):
    """``fused=True`` steps run on the device (xshard.core.decompositions; they ran ATen's
    kernel on the CPU fallback, reading every parameter, gradient and moment to the host):
    losses, parameters and state equal eager's fused CPU kernels."""
    data = batches(4)
    ref = make_model()
    ref_opt = FUSED[name](ref.parameters())
    ref_losses = train(ref, ref_opt, data, "cpu")
    model = make_model().to(DEV)
    opt = FUSED[name](model.parameters())
    with counting() as d:
        losses = train(model, opt, data, DEV, sync=True)
    assert d["cpu_fallbacks"] == {}
    assert d["compiles"] <= 2
    assert_same(losses, ref_losses, **TOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p, q, **TOL)
    for st, ref_st in zip(opt.state.values(), ref_opt.state.values()):
        assert st.keys() == ref_st.keys()
        for k in ref_st:
            assert_same(st[k], ref_st[k], **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_adam_of_16_bit_parameters(dtype):
    """16-bit parameters and moments are updated in float32 and rounded once, as ATen's kernel."""
    data = batches(3)
    ref = make_model().to(dtype)
    model = copy.deepcopy(ref).to(DEV)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
            for m in (ref, model)]
    for (x, y) in data:
        for m, opt, dev in ((ref, opts[0], "cpu"), (model, opts[1], DEV)):
            F.cross_entropy(m(x.to(dev).to(dtype)).float(), y.to(dev)).backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == dtype
        assert_same(p, q, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["sgd_momentum", "adamw", "adagrad"])
def test_fused_optimizers_with_a_grad_scaler(name):
    """GradScaler hands a fused optimizer its scale and found_inf (no host read): the step whose
    gradients overflow leaves parameters and state as they were, and the others unscale the
    gradients in place; equal to eager's CPU kernels, no CPU fallback."""
    data = batches(5)
    ref = make_model()
    model = make_model().to(DEV)
    runs = []
    for m, dev in ((ref, "cpu"), (model, DEV)):
        opt = FUSED[name](m.parameters())
        scaler = torch.amp.GradScaler(dev if dev == "cpu" else "xshard", init_scale=2.0 ** 8,
                                      growth_interval=2)
        scales, grads = [], []
        with counting() as d:
            for i, (x, y) in enumerate(data):
                loss = F.cross_entropy(m(x.to(dev)), y.to(dev)) * (1e38 if i == 2 else 1.0)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                grads.append([p.grad.detach().clone() for p in m.parameters()])
                opt.zero_grad()
                scales.append(scaler.get_scale())
        runs.append((opt, scales, grads, d))
    (ref_opt, ref_scales, ref_grads, _), (opt, scales, grads, d) = runs
    assert d["cpu_fallbacks"] == {}
    assert scales == ref_scales and scales[2] < scales[1]
    assert_same(grads, ref_grads, **TOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p, q, **TOL)
    for st, ref_st in zip(opt.state.values(), ref_opt.state.values()):
        for k in ref_st:
            assert_same(st[k], ref_st[k], **TOL)


def test_steady_state_training_compiles_nothing():
    model = make_model().to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, batches(2), DEV, sync=True)
    with counting() as d:
        train(model, opt, batches(3, seed=5), DEV, sync=True)
    assert d["compiles"] == 0 and d["cache_hits"] == 3 and d["executions"] == 3


def test_model_state_dict_round_trip():
    model = make_model().to(DEV)
    sd = model.state_dict()
    assert all(v.device == DEV for v in sd.values())
    other = make_model(seed=3).to(DEV)
    other.load_state_dict(sd)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p.cpu(), q.cpu())
    # A CPU state dict loads into a device model and the reverse.
    cpu_model = make_model(seed=4)
    other.load_state_dict(cpu_model.state_dict())
    assert_same(other[0].weight, cpu_model[0].weight)
    cpu_model.load_state_dict(model.state_dict())
    assert torch.equal(cpu_model[0].weight, model[0].weight.cpu())


@pytest.mark.parametrize("name", ["sgd_momentum", "adamw"])
def test_optimizer_state_dict_round_trip(name):
    data = batches(4)
    ref = make_model()
    ref_opt = OPTIMIZERS[name](ref.parameters(), None)
    train(ref, ref_opt, data, "cpu")

    model = make_model().to(DEV)
    opt = OPTIMIZERS[name](model.parameters(), None)
    train(model, opt, data[:2], DEV, sync=True)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)

    resumed = make_model(seed=9).to(DEV)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt = OPTIMIZERS[name](resumed.parameters(), None)
    resumed_opt.load_state_dict(ckpt["opt"])
    for st in resumed_opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert v.device == DEV, k
    train(resumed, resumed_opt, data[2:], DEV, sync=True)
    for p, q in zip(resumed.parameters(), ref.parameters()):
        assert_same(p, q, **TOL)


def test_optimizer_state_dict_from_cpu_run():
    data = batches(3)
    ref = make_model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    train(ref, ref_opt, data[:1], "cpu")
    model = make_model().to(DEV)
    model.load_state_dict(ref.state_dict())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # (a CPU "step" would be shared)
    train(ref, ref_opt, data[1:], "cpu")
    train(model, opt, data[1:], DEV, sync=True)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p, q, **TOL)


def test_clip_grad_norm_and_grad_scaler_style_ops():
    ref = make_model()
    model = make_model().to(DEV)
    x, y = batches(1)[0]
    for m, dev in ((ref, "cpu"), (model, DEV)):
        F.cross_entropy(m(x.to(dev)), y.to(dev)).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    with counting() as d:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        xshard.sync()
    assert d["cpu_fallbacks"] == {}
    assert_same(norm, ref_norm, **TOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.grad, q.grad, **TOL)
