"""State and arguments that share data, and state whose storage or flags change between calls:
each compiled call computes what eager CPU PyTorch does (see [Note: slots sharing data] in
xshard/step/program.py). Before, every case here gave a silent wrong answer or lost data."""

import re
import types

import numpy as np
import pytest
import torch
import torch.nn as nn

import xshard
from compile_testing import DEV, MLP, assert_same_run, make_batches
from xshard.core import api
from xshard.step.errors import StateError


def _sgd_step(model, opt, extra=None):
    def train_step(*batch):
        loss = model(*batch)
        if extra is not None:
            loss = loss + extra(model)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return train_step


def _run(device, compiled, between=None, n=4, extra=None, make_state=None):
    """Trains the MLP ``n`` steps on ``device``; ``between(i, model, opt, state)`` runs before
    call ``i``. Returns the losses, the parameters and ``state`` on the CPU."""
    torch.manual_seed(0)
    model = MLP().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = make_state(model, device) if make_state else None
    fn = _sgd_step(model, opt, extra and (lambda m: extra(m, state)))
    step = xshard.compile(fn, state=list(state or ())) if compiled else fn
    losses = []
    for i, (x, y) in enumerate(make_batches("mlp", n)):
        if between is not None:
            between(i, model, opt, state)
        losses.append(step(x.to(device), y.to(device)).item())
    params = [p.detach().cpu() for p in model.parameters()]
    return losses, params, [t.cpu() for t in state or ()], step


def _assert_same(cpu, dev):
    torch.testing.assert_close(dev[0], cpu[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(cpu[1] + cpu[2], dev[1] + dev[2]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_state_copied_from_a_parameter_and_updated_by_the_step():
    """``ema.copy_(p)`` before the first call: ema and p hold one data node when the step is
    recorded, and the step then writes each; the program read the shared data once, so from the
    second call on ema was computed from p."""
    def make_state(model, device):
        ema = [torch.zeros_like(p, requires_grad=False) for p in model.parameters()]
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.copy_(p)
        return ema

    def extra(model, ema):
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.mul_(0.5).add_(p, alpha=0.5)
        return 0.0

    cpu = _run("cpu", False, extra=extra, make_state=make_state)
    dev = _run(DEV, True, extra=extra, make_state=make_state)
    _assert_same(cpu, dev)
    assert dev[3].traces == 2  # the second call finds ema and p apart, and records again
    assert "no longer holds the same data" in dev[3].retrace_reasons[0]


def test_state_read_but_not_written_keeps_data_it_shares_with_a_parameter():
    """An anchor copied from a weight and only read by the step: the step overwrites the weight,
    which must not consume the data the anchor still holds (it did: "Array has been deleted")."""
    def make_state(model, device):
        anchor = torch.zeros_like(model.fc1.weight, requires_grad=False)
        with torch.no_grad():
            anchor.copy_(model.fc1.weight)
        return [anchor]

    def extra(model, state):
        return (model.fc1.weight - state[0]).pow(2).sum()

    cpu = _run("cpu", False, extra=extra, make_state=make_state)
    dev = _run(DEV, True, extra=extra, make_state=make_state)
    _assert_same(cpu, dev)


def test_one_tensor_passed_twice_then_two():
    def f(a, b):
        return a * 2 + b

    step = xshard.compile(f)
    x, y = torch.ones(4), torch.full((4,), 5.0)
    same = x.to(DEV)
    torch.testing.assert_close(step(same, same).cpu(), f(x, x))
    torch.testing.assert_close(step(same, y.to(DEV)).cpu(), f(x, y))  # was f(x, x)
    torch.testing.assert_close(step(same, same).cpu(), f(x, x))
    torch.testing.assert_close(step(x.to(DEV), x.to(DEV)).cpu(), f(x, x))
    assert step.traces == 2 and "sharing a storage" in step.retrace_reasons[0]


def test_tied_parameters_untied_between_calls():
    """Two modules holding one parameter, then each its own: the program must read and update
    both (it kept reading and updating only the first)."""
    def make(device):
        torch.manual_seed(0)
        a, b = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
        b.weight = a.weight
        model = nn.Sequential(a, nn.Tanh(), b).to(device)
        return model

    def run(device, compiled):
        model = make(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_step = _sgd_step(lambda x: model(x).pow(2).sum(), opt)
        step = xshard.compile(train_step, state=[model]) if compiled else train_step
        losses = []
        g = torch.Generator().manual_seed(3)
        for i in range(4):
            if i == 2:
                with torch.no_grad():
                    model[2].weight = nn.Parameter(model[0].weight.detach().clone() * 0.5)
                opt.param_groups[0]["params"].append(model[2].weight)
            losses.append(step(torch.randn(2, 3, generator=g).to(device)).item())
        return losses, [p.detach().cpu() for p in model.parameters()]

    cpu, dev = run("cpu", False), run(DEV, True)
    assert_same_run(cpu, dev)


def test_parameter_data_assigned_between_calls():
    """``p.data = t``: the parameter now holds t's storage (it was ignored: the step kept
    reading and updating the old storage)."""
    def between(i, model, opt, state):
        if i == 2:
            model.fc1.weight.data = torch.full_like(model.fc1.weight, 0.3)

    cpu = _run("cpu", False, between=between)
    dev = _run(DEV, True, between=between)
    _assert_same(cpu, dev)


def test_parameter_frozen_between_calls():
    """``requires_grad_(False)`` between calls: the step records again and leaves the parameter
    alone (it kept updating it)."""
    def between(i, model, opt, state):
        if i == 2:
            model.fc1.weight.requires_grad_(False)

    cpu = _run("cpu", False, between=between)
    dev = _run(DEV, True, between=between)
    _assert_same(cpu, dev)
    assert dev[3].traces == 2 and "requires_grad" in dev[3].retrace_reasons[0]


def test_returned_view_of_state_shares_its_storage():
    """``return model.fc1.weight.detach()``: as in eager, each returned tensor shares the weight's
    storage; keeping them across calls kept arrays the next call consumed ("Array has been
    deleted")."""
    def run(device, compiled):
        torch.manual_seed(0)
        model = MLP().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_step(x, y):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            return model.fc1.weight.detach(), model.fc2.bias[1:]

        step = xshard.compile(train_step) if compiled else train_step
        kept = [step(x.to(device), y.to(device)) for x, y in make_batches("mlp", 3)]
        return [(w.cpu(), b.detach().cpu()) for w, b in kept]

    cpu, dev = run("cpu", False), run(DEV, True)
    for (w1, b1), (w2, b2) in zip(cpu, dev):
        torch.testing.assert_close(w2, w1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b2, b1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dev[0][0], dev[-1][0], rtol=0, atol=0)  # one storage


def test_returned_results_that_view_one_another_share_a_storage():
    """``return h, h[0], loss, loss.detach()``: as in eager, each replay's results view one
    storage, so a write through one is seen through the others, and a tensor returned twice is
    one object (a replay returned separate tensors)."""
    def run(device, compiled):
        torch.manual_seed(0)
        model = MLP().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_step(x, y):
            h = model.fc1(x)
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            d = loss.detach()
            return {"h": h.detach(), "row": h.detach()[1], "col": h.detach()[:, 2:4].t(),
                    "loss": d, "again": d, "same": d.view(1)}

        step = xshard.compile(train_step) if compiled else train_step
        got = []
        for x, y in make_batches("mlp", 4):
            out = step(x.to(device), y.to(device))
            out["row"].mul_(2)  # seen through h and col
            out["col"][0].add_(1)  # seen through h (and row where they meet)
            out["same"].add_(3)  # seen through loss and again
            assert out["again"] is out["loss"]
            got.append({k: v.cpu() for k, v in out.items()})
        return got, step

    cpu, _ = run("cpu", False)
    dev, step = run(DEV, True)
    assert step.traces == 1
    for a, b in zip(dev, cpu):
        for k in b:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_returned_result_also_stored_in_state_is_not_consumed():
    """A running total kept in a buffer and returned: the next call reads the buffer (and
    consumes its data), which must not consume the tensor returned before."""
    torch.manual_seed(0)
    model = MLP().to(DEV)
    model.register_buffer("total", torch.zeros((), device=DEV))

    @xshard.compile
    @torch.no_grad()
    def evaluate(x, y):
        total = model.total + model(x, y)
        model.total.copy_(total)  # the buffer now holds the returned value's data
        return total

    batches = make_batches("mlp", 4)
    kept = [evaluate(x.to(DEV), y.to(DEV)) for x, y in batches]
    cpu = MLP()
    cpu.load_state_dict({k: v.cpu() for k, v in model.state_dict().items() if k != "total"})
    want = torch.cumsum(torch.stack([cpu(x, y).detach() for x, y in batches]), 0)
    torch.testing.assert_close(torch.stack([t.cpu() for t in kept]), want)
    torch.testing.assert_close(model.total.cpu(), want[-1])


@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_step_counts_are_stored_once(foreach):
    """Every parameter's step count is one value, stored once and read once; a count changed by
    hand makes the step record again, and every count then follows eager."""
    def run(device, compiled):
        torch.manual_seed(0)
        model = MLP().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach,
                                capturable=device != "cpu")
        fn = _sgd_step(model, opt)
        step = xshard.compile(fn) if compiled else fn
        for i, (x, y) in enumerate(make_batches("mlp", 7)):
            if i == 3:
                with torch.no_grad():
                    opt.state[model.fc2.bias]["step"].fill_(10.0)
            if i == 5:  # as when resuming from a checkpoint: every count its own tensor
                with torch.no_grad():
                    for s in opt.state.values():
                        s["step"] = s["step"].clone().fill_(20.0)
            step(x.to(device), y.to(device))
            if compiled and i in (2, 5):
                counts = {id(api.storage_value(api.storage(s["step"])))
                          for s in opt.state.values()}
                assert len(counts) == 1
                state_inputs = [k for k, *_ in step._last.inputs if k == "state"]
                assert len(state_inputs) == 3 * 4 + 1  # params, two moments; one count
        return [p.detach().cpu() for p in model.parameters()], \
            [float(s["step"]) for s in opt.state.values()], step

    cpu, dev = run("cpu", False), run(DEV, True)
    assert dev[1] == cpu[1] == [22.0] * 4
    for a, b in zip(cpu[0], dev[0]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # State created, steady, a count apart, then the counts equal again.
    assert dev[2].traces == 4


class _Counting(MLP):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, y):
        self.calls = self.calls + 1  # equal to Adam's step count after every call
        return super().forward(x, y)


def test_equal_scalars_the_step_writes_apart_are_read_apart():
    """A buffer counting calls and Adam's step counts hold one value at entry, so the recording
    reads them as one input; the step writes them apart, and the next recording keeps them apart.
    It joined them again, and every call recorded the step again."""
    def run(device, compiled):
        torch.manual_seed(0)
        model = _Counting().to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=device != "cpu")
        fn = _sgd_step(model, opt)
        step = xshard.compile(fn) if compiled else fn
        losses = [step(x.to(device), y.to(device)).item() for x, y in make_batches("mlp", 6)]
        return losses, [p.detach().cpu() for p in model.parameters()], model.calls.cpu(), step

    cpu, dev = run("cpu", False), run(DEV, True)
    torch.testing.assert_close(dev[0], cpu[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(cpu[1], dev[1]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert dev[2].item() == cpu[2].item() == 6
    # State created, then joined (apart after the call), then apart for good.
    assert dev[3].traces == 3, dev[3].retrace_reasons


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.scale = 1.0  # a Python setting the forward reads
        self.extra = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return (self.fc(x) * self.scale + self.extra).pow(2).sum()


@pytest.mark.parametrize("change", ["module setting", "parameter added to a group",
                                    "parameter removed from a group"])
def test_settings_and_param_groups_changed_between_calls(change):
    """Each was ignored by the replay: a module's Python setting is built into the program, and
    a param group's parameter list decides what the optimizer updates."""
    def run(device, compiled):
        torch.manual_seed(0)
        model = _Scaled().to(device)
        opt = torch.optim.SGD([model.fc.weight, model.fc.bias], lr=0.1)
        train_step = _sgd_step(model, opt)
        step = xshard.compile(train_step) if compiled else train_step
        losses = []
        for i in range(4):
            if i == 2:
                if change == "module setting":
                    model.scale = 3.0
                elif change == "parameter added to a group":
                    opt.param_groups[0]["params"].append(model.extra)
                else:
                    opt.param_groups[0]["params"].pop()
            losses.append(step(torch.ones(1, 2).to(device)).item())
        return losses, [p.detach().cpu() for p in model.parameters()], step

    cpu, dev = run("cpu", False), run(DEV, True)
    assert_same_run(cpu, dev)
    want = ("_Scaled.scale: 1.0 -> 3.0" if change == "module setting"
            else "number of parameters in param group 0")
    assert any(want in reason for reason in dev[2].retrace_reasons)


def test_gradient_let_go_by_the_step_raises_when_read():
    """A gradient the step accumulates into and then sets to None (zero_grad): the old tensor,
    still held by the caller, is not computed by the program; reading it says so (it read
    arrays the step had consumed: "Array has been deleted")."""
    torch.manual_seed(0)
    model = MLP().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = (t.to(DEV) for t in make_batches("mlp", 1)[0])
    model(x, y).backward()  # a gradient before the first call
    held = model.fc1.weight.grad
    step = xshard.compile(_sgd_step(model, opt))
    step(x, y)
    assert model.fc1.weight.grad is None
    with pytest.raises(xshard.step.errors.StateError, match="zero_grad"):
        held.cpu()
    step(x, y)
    xshard.sync()  # nothing pending reads a consumed array
    assert model.fc1.weight.cpu().isfinite().all()


def test_autocast_on_off_and_dtype_between_calls():
    """A step recorded under ``torch.autocast`` holds its casts: called without autocast, or with
    another dtype, it records again (it replayed the first recording's bfloat16 program)."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16).to(DEV)

    @torch.no_grad()
    def forward(x):
        return model(x)

    step = xshard.compile(forward)
    x = torch.randn(4, 16).to(DEV)
    for dtype in (torch.bfloat16, None, torch.float16, torch.bfloat16):
        if dtype is None:
            got, want = step(x), forward(x)
        else:
            with torch.autocast("xshard", dtype=dtype):
                got, want = step(x), forward(x)
        assert got.dtype == want.dtype == (dtype or torch.float32)
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=0)
    assert step.traces == 3 and "autocast" in step.retrace_reasons[0]


SCALE = 1.0  # a global the step reads (test_python_settings_read_by_the_step_function)


def test_python_settings_read_by_the_step_function():
    """A global and a closure variable the step reads are built into the program; changing
    either records the step again (they were ignored). A name the step uses only as an attribute
    (``opt.step()``) is not the global of that name."""
    global SCALE
    torch.manual_seed(0)
    model = MLP().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weight = 0.5

    def train_step(x, y):
        loss = model(x, y) * SCALE * weight
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step = xshard.compile(train_step)
    x, y = (t.to(DEV) for t in make_batches("mlp", 1)[0])
    globals()["step"] = 0  # a loop counter named like opt.step: never compared
    losses = []
    try:
        for i in range(6):
            globals()["step"] = i
            if i == 2:
                SCALE = 2.0
            if i == 4:
                weight = 3.0
            expected = model(x, y).item() * SCALE * weight
            losses.append((step(x, y).item(), expected))
    finally:
        SCALE = 1.0
        del globals()["step"]
    for got, want in losses:
        assert got == pytest.approx(want, rel=1e-5)
    assert step.traces == 3
    assert "global 'SCALE': 1.0 -> 2.0" in step.retrace_reasons[0]
    assert "closure variable 'weight': 0.5 -> 3.0" in step.retrace_reasons[1]


CFG = types.SimpleNamespace(weights={"kl": 1.0}, scale=np.float32(1.0))


class _Configured(MLP):
    def __init__(self):
        super().__init__()
        self.cfg = types.SimpleNamespace(temperature=1.0)

    def forward(self, x, y):
        return super().forward(x / self.cfg.temperature, y)


class _Trainer:
    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.cfg = types.SimpleNamespace(clip=10.0)
        self.schedule = [1.0]

    def step(self, x, y):
        loss = self.model(x, y) * CFG.scale * CFG.weights["kl"] * self.schedule[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)
        self.opt.step()
        self.opt.zero_grad()
        return loss


def test_settings_read_through_objects():
    """Settings the step reads through objects (a global config's attribute and dict entry, an
    item of a closure's list, of the trainer's list and an attribute of its config, a module's
    config read in its forward) are compared on every call (see [Note: settings read through
    objects]); each was built in, and a change silently ignored."""
    changes = [lambda t, o: None, lambda t, o: setattr(CFG, "scale", np.float32(2.0)),
               lambda t, o: CFG.weights.__setitem__("kl", 0.5),
               lambda t, o: t.schedule.__setitem__(0, 3.0),
               lambda t, o: setattr(t.cfg, "clip", 0.01),
               lambda t, o: setattr(t.model.cfg, "temperature", 4.0),
               lambda t, o: o.__setitem__(0, 2.0)]

    def run(device, compiled):
        CFG.scale, CFG.weights["kl"] = np.float32(1.0), 1.0
        torch.manual_seed(0)
        model = _Configured().to(device)
        trainer = _Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
        offset = [0.0]

        def train_step(x, y):
            return trainer.step(x, y) + offset[0]

        step = xshard.compile(train_step) if compiled else train_step
        losses = []
        for change, (x, y) in zip(changes, make_batches("mlp", len(changes))):
            change(trainer, offset)
            losses.append(step(x.to(device), y.to(device)).item())
        return losses, [p.detach().cpu() for p in model.parameters()], step

    _assert_recorded_for(run("cpu", False), run(DEV, True), len(changes), [
        "CFG.scale: ", "CFG.weights['kl']: 1.0 -> 0.5", "_Trainer.schedule[0]: 1.0 -> 3.0",
        "_Trainer.cfg.clip: 10.0 -> 0.01", "_Configured.cfg.temperature: 1.0 -> 4.0",
        "offset[0]: 0.0 -> 2.0"])


def _assert_recorded_for(cpu, dev, traces: int, reasons: list) -> None:
    """``(losses, parameters, step)`` of eager and compiled runs: the same losses and parameters,
    and the compiled step recorded ``traces`` times, for ``reasons`` (one part of each)."""
    torch.testing.assert_close(dev[0], cpu[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(cpu[1], dev[1]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    got = dev[2].retrace_reasons
    assert dev[2].traces == traces, got
    for want, reason in zip(reasons, got):
        assert want in reason, got


FLAGS = []  # a global list of settings (test_settings_computed_from_containers)


def test_settings_computed_from_containers():
    """What the step computes from a list or dict of settings (``"double" in flags``, ``lrs[i]``,
    ``cfg.get("w")``) in its closure, globals or default arguments, and the settings it reads
    through a default argument (``cfg["w"]``, ``ns.w``): each was built in, and a change made in
    place between calls silently ignored. Their contents are compared by value now."""
    def run(device, compiled):
        FLAGS.clear()
        torch.manual_seed(0)
        model = MLP().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        flags, weights, i = [], {"w": 1.0}, 0
        scales = [1.0, 2.0]
        default_cfg, default_ns = {"w": 1.0}, types.SimpleNamespace(w=1.0)

        def train_step(x, y, cfg=default_cfg, ns=default_ns):
            loss = model(x, y) * (2.0 if "double" in flags else 1.0) * weights.get("w", 0.0)
            loss = loss * scales[i] * cfg["w"] * ns.w * (0.5 if "half" in FLAGS else 1.0)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        changes = [lambda: None, lambda: flags.append("double"),
                   lambda: weights.__setitem__("w", 3.0), lambda: scales.__setitem__(0, 0.5),
                   lambda: default_cfg.__setitem__("w", 4.0), lambda: setattr(default_ns, "w", 2.0),
                   lambda: FLAGS.append("half"), lambda: None]
        step = xshard.compile(train_step) if compiled else train_step
        losses = []
        for change, (x, y) in zip(changes, make_batches("mlp", len(changes))):
            change()
            losses.append(step(x.to(device), y.to(device)).item())
        return losses, [p.detach().cpu() for p in model.parameters()], step

    _assert_recorded_for(run("cpu", False), run(DEV, True), 7, [
        "closure variable 'flags' (contents): () -> ('double',)",
        "closure variable 'weights' (contents)", "closure variable 'scales'",
        "cfg['w']: 1.0 -> 4.0", "ns.w: 1.0 -> 2.0", "global 'FLAGS' (contents): () -> ('half',)"])


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
def test_learning_rate_read_inside_the_step(optimizer):
    """``opt.param_groups[0]["lr"]`` read by the step (logged, or scaling a loss term) is the
    call's learning rate, as the update's is (it was refused: "the step changes ...['lr']")."""
    def run(device, compiled):
        torch.manual_seed(0)
        model = MLP().to(device)
        opt = optimizer(model.parameters(), lr=0.1)

        def train_step(x, y):
            lr = opt.param_groups[0]["lr"]
            loss = model(x, y) * (1.0 + lr)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss, lr * 2.0

        step = xshard.compile(train_step) if compiled else train_step
        out = []
        for i, (x, y) in enumerate(make_batches("mlp", 4)):
            if i == 2:
                opt.param_groups[0]["lr"] = 0.05
            loss, lr = step(x.to(device), y.to(device))
            out.append((loss.item(), float(lr)))
        return out, [p.detach().cpu() for p in model.parameters()], step

    cpu, dev = run("cpu", False), run(DEV, True)
    torch.testing.assert_close(dev[0], cpu[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(cpu[1], dev[1]):  # (AdamW's capturable form: see the README)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert dev[2].traces <= 2, dev[2].retrace_reasons  # (AdamW: its first step creates state)


@pytest.mark.parametrize("where", ["dict", "list", "object"])
def test_counter_the_step_increments_in_a_container_is_refused(where):
    """``state["step"] += 1`` (or of a list entry, an object's attribute) in the step: a replay
    cannot count, and the counter stayed at 1 silently; refused as ``n = n + 1`` is."""
    state, counts, ns = {"step": 0}, [0], types.SimpleNamespace(step=0)
    torch.manual_seed(0)
    model = MLP().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(x, y):
        loss = _sgd_step(model, opt)(x, y)
        if where == "dict":
            state["step"] += 1
        elif where == "list":
            counts[0] += 1
        else:
            ns.step += 1
        return loss

    x, y = (t.to(DEV) for t in make_batches("mlp", 1)[0])
    name = {"dict": "state['step']", "list": "counts[0]", "object": "ns.step"}[where]
    with pytest.raises(StateError, match=re.escape(f"the step changes {name} (0 -> 1)")):
        xshard.compile(train_step)(x, y)
    assert (state["step"], counts[0], ns.step) == (0, 0, 0)  # put back
    train_step(x, y)  # the lazy path counts


@pytest.mark.parametrize("where", ["module", "global"])
def test_hooks_registered_and_removed_between_calls(where):
    """Hooks run only while the step is recorded: one registered or removed since records the
    step again (the replay kept running without it, or with it)."""
    def run(device, compiled):
        torch.manual_seed(0)
        model = MLP().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_step = _sgd_step(model, opt)
        step = xshard.compile(train_step) if compiled else train_step
        handle = None
        losses = []
        for i, (x, y) in enumerate(make_batches("mlp", 5)):
            if i == 2:
                double = lambda module, args, out: out * 2  # noqa: E731
                handle = (model.fc1.register_forward_hook(double) if where == "module" else
                          nn.modules.module.register_module_forward_hook(
                              lambda module, args, out: out * 2 if module is model.fc1 else out))
            if i == 4:
                handle.remove()
            losses.append(step(x.to(device), y.to(device)).item())
        return losses, [p.detach().cpu() for p in model.parameters()], step

    cpu, dev = run("cpu", False), run(DEV, True)
    assert_same_run(cpu, dev)
    # Removing the hook goes back to the first program.
    assert dev[2].traces == 2 and "hooks" in dev[2].retrace_reasons[0]
