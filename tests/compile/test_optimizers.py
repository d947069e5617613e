"""Every torch.optim optimizer in a compiled step equals the lazy path over 10 steps with a
learning rate changed every step (see [Note: optimizers in a compiled step] in
xshard/step/optim.py), and learning rates of every kind PyTorch accepts are read afresh or
guarded: none is built into a replay unseen."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import xshard
from compile_testing import (DEV, OPTIMIZERS, assert_models_close, assert_state_close,
                             compiled_step, make_batches, scheduler, train_compiled, train_lazy,
                             train_update, twins)
from xshard.step.errors import StateError

MORE = {
    "adadelta": lambda p, fe: torch.optim.Adadelta(p, lr=0.5, weight_decay=0.01, foreach=fe),
    "adamax": lambda p, fe: torch.optim.Adamax(p, lr=0.01, foreach=fe),
    "asgd": lambda p, fe: torch.optim.ASGD(p, lr=0.05, foreach=fe),
    "nadam": lambda p, fe: torch.optim.NAdam(p, lr=0.01, weight_decay=0.01,
                                             decoupled_weight_decay=True, foreach=fe),
    "radam": lambda p, fe: torch.optim.RAdam(p, lr=0.01, foreach=fe),
    "rmsprop": lambda p, fe: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True,
                                                 foreach=fe),
    "rprop": lambda p, fe: torch.optim.Rprop(p, lr=0.01, foreach=fe),
    "amsgrad": lambda p, fe: torch.optim.Adam(p, lr=0.01, amsgrad=True, foreach=fe),
}
# ``fused=True``: one op per step over every list (see [Note: fused optimizers] in
# xshard/core/decompositions.py); its step counts live on the device, Adagrad's too.
FUSED = {
    "fused_sgd": lambda p, fe: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                               fused=True),
    "fused_adam_amsgrad": lambda p, fe: torch.optim.Adam(p, lr=1e-2, amsgrad=True, fused=True),
    "fused_adamw": lambda p, fe: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "fused_adagrad": lambda p, fe: torch.optim.Adagrad(p, lr=0.1, fused=True),
}
# Recordings over the 10 steps: the first step creates the state, the second is the steady step.
# ASGD's step count and mu are equal after one step and read as one input, until they differ.
# The for-loop forms of RMSprop and Adadelta read the rate as a Python number: one recording per
# rate, and the scheduler changes it every step.
# Adagrad creates its state with the optimizer: one recording.
RECORDINGS = {"asgd": 3, "fused_adagrad": 1}
READS_RATE = {("rmsprop", False), ("adadelta", False)}
TOL = dict(rtol=1e-4, atol=2e-5)  # capturable forms compute bias corrections in float32


def _check(opt_name, foreach):
    OPTIMIZERS.update(MORE, **FUSED)
    (m1, o1), (m2, o2) = twins("mlp", opt_name, foreach)
    data = make_batches("mlp")
    lazy = train_lazy(m1, o1, data, scheduler(o1))
    step = compiled_step(m2, o2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comp = train_compiled(step, data, scheduler(o2))
    torch.testing.assert_close(comp, lazy, **TOL)
    assert_models_close(m1, m2, **TOL)
    assert_state_close(o1, o2, **TOL)
    reads = (opt_name, foreach) in READS_RATE
    assert step.traces == (len(data) if reads else RECORDINGS.get(opt_name, 2)), \
        step.retrace_reasons
    warned = [str(w.message) for w in caught if "as a Python number" in str(w.message)]
    assert len(warned) == (1 if reads or opt_name == "rprop" else 0), warned


@pytest.mark.parametrize("opt_name", list(MORE))
def test_optimizer(opt_name):
    _check(opt_name, None)


@pytest.mark.parametrize("opt_name", list(FUSED))
def test_fused_optimizer(opt_name):
    _check(opt_name, None)


@pytest.mark.parametrize("opt_name", ["rmsprop", "adadelta", "rprop"])
def test_for_loop_form_reading_the_rate(opt_name):
    _check(opt_name, False)


@pytest.mark.slow
@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for_loop"])
@pytest.mark.parametrize("opt_name", list(MORE))
def test_optimizer_forms(opt_name, foreach):
    _check(opt_name, foreach)


def _linear_step(make_optimizer):
    """A step training a small Linear with the optimizer ``make_optimizer(params)`` makes."""
    model = nn.Linear(3, 2).to(DEV)
    opt = make_optimizer(model.parameters())
    return lambda x: train_update(lambda v: model(v).sum(), opt, x)


def test_adagrad_is_refused_naming_its_host_step_count():
    train_step = _linear_step(lambda p: torch.optim.Adagrad(p, lr=0.1))
    with pytest.raises(StateError, match=r"state\[.*\]\['step'\], a Python value"):
        xshard.compile(train_step)(torch.ones(2, 3).to(DEV))
    loss = train_step(torch.ones(2, 3).to(DEV))  # the lazy path still runs it
    assert torch.isfinite(loss.cpu())


def test_averaged_model_updated_inside_the_step_is_refused_and_works_between_calls():
    """AveragedModel counts its updates in a CPU buffer: updated inside a compiled step it is
    refused, naming the buffer and the fix; updated between calls it matches eager."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    def run(device, compiled, inside):
        torch.manual_seed(0)
        model = nn.Linear(3, 2).to(device)
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x):
            loss = train_update(lambda v: model(v).sum(), opt, x)
            if inside:
                ema.update_parameters(model)
            return loss

        step = xshard.compile(step) if compiled else step
        for i in range(3):
            step(torch.full((2, 3), float(i + 1)).to(device))
            if not inside:
                ema.update_parameters(model)
        return [p.detach().cpu() for p in ema.module.parameters()], int(ema.n_averaged)

    with pytest.raises(StateError, match=r"n_averaged, a Python value .* Make that update "
                                         r"outside the compiled step, between calls"):
        run(DEV, compiled=True, inside=True)
    want, n = run("cpu", compiled=False, inside=False)
    got, m = run(DEV, compiled=True, inside=False)
    assert n == m == 3
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a)


def _sgd_run(device, lrs, compiled, **kw):
    """Three SGD steps on ``device`` with learning rate ``lrs[i]`` at step ``i`` (a callable
    ``lrs[i](opt)`` changes it in place instead)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lrs[0], **kw)

    def train_step(x):
        loss = model(x).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step = xshard.compile(train_step) if compiled else train_step
    for lr in lrs:
        if callable(lr):
            lr(opt)
        else:
            opt.param_groups[0]["lr"] = lr
        step(torch.ones(4, 3).to(device))
    return model.weight.detach().cpu(), step


def _fill(value):
    return lambda opt: opt.param_groups[0]["lr"].fill_(value)


def _loaded(value):
    """The rate set by loading a state dict (resuming): the optimizer gets new group dicts."""
    def load(opt):
        state = opt.state_dict()
        state["param_groups"][0]["lr"] = value
        opt.load_state_dict(state)

    return load


def _new_groups(value):
    def replace(opt):
        opt.param_groups = [dict(opt.param_groups[0], lr=value)]

    return replace


@pytest.mark.parametrize("lrs", [
    lambda: [np.float64(0.1), np.float64(0.1), np.float64(0.5)],  # was built in, silently
    lambda: [np.float32(0.1), np.float32(0.3), np.float32(0.5)],
    lambda: [0.1, 1, np.int64(2)],
    lambda: [torch.tensor(0.1), torch.tensor(0.3), _fill(0.5)],
    # were ignored: the replay read the rate from the groups the step was recorded with
    lambda: [0.1, _loaded(0.3), _new_groups(0.5)],
], ids=["float64", "float32", "int", "cpu_tensor", "new_groups"])
@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for_loop"])
def test_learning_rates_of_every_kind_are_read_each_call(lrs, foreach):
    eager, _ = _sgd_run("cpu", lrs(), False, foreach=foreach)
    compiled, step = _sgd_run(DEV, lrs(), True, foreach=foreach)
    torch.testing.assert_close(compiled, eager)
    assert step.traces == 1, step.retrace_reasons


def test_device_tensor_learning_rate_is_guarded():
    eager, _ = _sgd_run("cpu", [torch.tensor(0.1), torch.tensor(0.1), _fill(0.5)], False)
    compiled, step = _sgd_run(DEV, [torch.tensor(0.1).to(DEV), torch.tensor(0.1).to(DEV),
                                    _fill(0.5)], True)
    torch.testing.assert_close(compiled, eager)
    assert step.traces == 3, step.retrace_reasons  # a replaced then rewritten constant


def test_host_read_in_an_optimizer_step_names_the_optimizer_and_the_fix():
    """A device-tensor rate is a constant of the program, which the for-loop RMSprop reads as a
    Python number: refused, naming the optimizer and the form that keeps it a tensor."""
    train_step = _linear_step(
        lambda p: torch.optim.RMSprop(p, lr=torch.tensor(0.01).to(DEV), foreach=False))
    with pytest.raises(Exception, match=r"RMSprop\.step, which reads a tensor as a Python number "
                                        r"in its for-loop form: pass foreach=True"):
        xshard.compile(train_step)(torch.ones(2, 3).to(DEV))


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_grad_scaler_with_a_fused_optimizer(name):
    """The AMP recipe (scale, backward, GradScaler.step, update) with a fused optimizer compiles:
    the scaler's scale and growth tracker are state (created at the first call), the overflow
    flag never leaves the device, and a step whose gradients overflow is skipped and backs the
    scale off, as in eager on the CPU; one recording per optimizer-state layout, no warning."""
    def run(device, compiled):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(device)
        opt = getattr(torch.optim, name)(model.parameters(), lr=0.05, fused=True)
        scaler = torch.amp.GradScaler("cpu" if device == "cpu" else "xshard", init_scale=256.0,
                                      growth_interval=2)

        def train_step(x, y, blow_up):
            loss = torch.nn.functional.mse_loss(model(x), y) * blow_up
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return loss

        step = xshard.compile(train_step) if compiled else train_step
        g = torch.Generator().manual_seed(1)
        scales = []
        for i in range(7):
            x, y = torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)
            blow_up = torch.tensor(1e38 if i == 3 else 1.0)  # its scaled gradients overflow
            step(x.to(device), y.to(device), blow_up.to(device))
            scales.append(scaler.get_scale())
        return scales, [p.detach().cpu() for p in model.parameters()], step

    cpu = run("cpu", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dev = run(DEV, True)
    assert dev[0] == cpu[0] and cpu[0][3] < cpu[0][2]
    for a, b in zip(cpu[1], dev[1]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert dev[2].traces == (1 if name == "SGD" else 2), dev[2].retrace_reasons


def test_grad_scaler_with_an_unfused_optimizer_names_the_fix():
    model = nn.Linear(3, 2).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("xshard")

    @xshard.compile
    def train_step(x):
        scaler.scale(model(x).sum()).backward()
        scaler.step(opt)
        scaler.update()

    with pytest.raises(Exception, match=r"GradScaler\.step asking whether the gradients "
                                        r"overflowed.*pass fused=True"):
        train_step(torch.ones(2, 3).to(DEV))
