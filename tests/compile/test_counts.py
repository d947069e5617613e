"""How often a compiled step is recorded and compiled: once for a steady training loop (learning
rate changes included), again for a new input shape or a new program, with a log line saying what
changed; and no Python of the step runs on a replay."""

import dataclasses
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xshard
from compile_testing import DEV, MLP, make_batches, squared_output_step

LOG = "xshard"


def setup(lr=0.1, momentum=0.9):
    torch.manual_seed(0)
    model = MLP().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return model, opt


def step_of(model, opt, counter=None):
    def train_step(x, y):
        if counter is not None:
            counter.append(1)  # Python: runs only while the step is recorded
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return xshard.compile(train_step)


def prime(model, opt, data):
    """One lazy step: the optimizer state exists, as after any first step."""
    x, y = data[0]
    model(x.to(DEV), y.to(DEV)).backward()
    opt.step()
    opt.zero_grad()
    xshard.sync()


def test_one_recording_and_one_compile_over_ten_steps():
    model, opt = setup()
    data = make_batches("mlp", 11)
    prime(model, opt, data)
    counter = []
    step = step_of(model, opt, counter)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)  # a new rate every step
    before = xshard.metrics.snapshot()
    for x, y in data[1:]:
        step(x.to(DEV), y.to(DEV))
        sched.step()
    xshard.sync()
    after = xshard.metrics.snapshot()
    assert step.traces == 1 and step.calls == 10 and step.retrace_reasons == []
    assert len(counter) == 1  # the function's Python ran once
    # One graph compiled (the step: or found compiled, when an earlier test compiled the same
    # one), one execution per call, no lazy work left to sync.
    looked_up = ("compiles", "cache_hits")
    assert sum(after[k] - before[k] for k in looked_up) == 1
    assert after["executions"] - before["executions"] == 10
    assert after["cpu_fallbacks"] == before["cpu_fallbacks"]


def test_fresh_optimizer_records_twice_then_never(caplog):
    model, opt = setup()
    data = make_batches("mlp", 10)
    step = step_of(model, opt)
    with caplog.at_level(logging.INFO, logger=LOG):
        step(*(t.to(DEV) for t in data[0]))
        step(*(t.to(DEV) for t in data[1]))
    assert step.traces == 2
    assert "parameters with state in the SGD: 0 -> 4" in caplog.text
    before = xshard.metrics.snapshot()["compiles"]
    for x, y in data[2:]:
        step(x.to(DEV), y.to(DEV))
    assert step.traces == 2
    assert xshard.metrics.snapshot()["compiles"] == before


def test_new_shape_records_again_and_old_shape_reuses(caplog):
    model, opt = setup()
    data = make_batches("mlp", 3)
    prime(model, opt, data)
    step = step_of(model, opt)
    x, y = (t.to(DEV) for t in data[1])
    step(x, y)
    with caplog.at_level(logging.INFO, logger=LOG):
        step(x[:5], y[:5])
    assert step.traces == 2
    assert "argument 0: shape tensor[8, 8] float32" in caplog.text
    assert "-> tensor[5, 8] float32" in caplog.text
    compiles = xshard.metrics.snapshot()["compiles"]
    step(x, y)  # the first program is kept
    step(x[:5], y[:5])
    assert step.traces == 2
    assert xshard.metrics.snapshot()["compiles"] == compiles


def test_program_changes_record_again(caplog):
    model, opt = setup()
    data = make_batches("mlp", 8)
    prime(model, opt, data)
    step = step_of(model, opt)
    batches = [tuple(t.to(DEV) for t in b) for b in data]
    step(*batches[1])
    with caplog.at_level(logging.INFO, logger=LOG):
        opt.param_groups[0]["momentum"] = 0.5  # a hyper-parameter that shapes the program
        step(*batches[2])
        opt.param_groups[0]["momentum"] = 0.9
        step(*batches[3])  # the first program again
        model.eval()
        step(*batches[4])
        model.train()
        step(*batches[5])  # the first program again
        extra = torch.zeros(3, device=DEV, requires_grad=True)
        opt.add_param_group({"params": [extra], "lr": 0.01})
        step(*batches[6])
    assert step.traces == 4, step.retrace_reasons
    assert step.retrace_reasons == ["optimizer param_groups[0]['momentum']: 0.9 -> 0.5",
                                    "MLP.training: True -> False",
                                    "number of optimizer param groups: 1 -> 2"]
    assert "recording the step again (recording 4): number of optimizer param groups" in \
        caplog.text


def test_grad_mode_is_part_of_the_guard():
    torch.manual_seed(0)
    model = MLP().to(DEV)

    @xshard.compile
    def evaluate(x, y):
        return model(x, y)

    x, y = (t.to(DEV) for t in make_batches("mlp", 1)[0])
    with torch.no_grad():
        a = evaluate(x, y)
    b = evaluate(x, y)
    assert evaluate.traces == 2 and evaluate.retrace_reasons == ["grad mode: False -> True"]
    torch.testing.assert_close(a.cpu(), b.cpu())
    torch.testing.assert_close(a.cpu(), model(x, y).cpu())


def test_state_changed_between_calls_is_read():
    """Parameters written lazily between calls (here scaled in place) are computed first and read
    by the next call, with no new recording."""
    data = make_batches("mlp", 3)
    runs = []
    for compiled in (False, True):
        model, opt = setup(momentum=0.0)
        step = step_of(model, opt) if compiled else None
        losses = []
        for i, (x, y) in enumerate(data):
            if i == 2:
                with torch.no_grad():
                    model.fc1.weight.mul_(0.5)
            if compiled:
                losses.append(step(x.to(DEV), y.to(DEV)))
            else:
                loss = model(x.to(DEV), y.to(DEV))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss)
        runs.append(([float(l.item()) for l in losses], model.fc1.weight.cpu()))
    assert step.traces == 1
    assert runs[1][0] == runs[0][0]
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=1e-6, atol=1e-7)  # fusion: ulps


@pytest.mark.parametrize("n", [0.5, 2.0])
def test_python_number_argument_is_an_input(n):
    model, opt = setup(momentum=0.0)
    data = make_batches("mlp", 4)
    prime(model, opt, data)

    @xshard.compile
    def scaled_step(x, y, scale):
        loss = model(x, y) * scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    torch.manual_seed(0)
    ref, ref_opt = setup(momentum=0.0)
    prime(ref, ref_opt, data)
    for i, (x, y) in enumerate(data[1:]):
        scale = n * (i + 1)
        loss = scaled_step(x.to(DEV), y.to(DEV), scale)
        ref_loss = ref(x.to(DEV), y.to(DEV)) * scale
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.cpu(), ref_loss.cpu())
    assert scaled_step.traces == 1
    torch.testing.assert_close(model.fc1.weight.cpu(), ref.fc1.weight.cpu())


def test_static_argument_records_per_value():
    torch.manual_seed(0)
    model = MLP().to(DEV)

    @xshard.compile(static_argnames="activation")
    def forward(x, activation):
        return getattr(F, activation)(model.fc1(x))

    x = torch.randn(4, 8).to(DEV)
    torch.testing.assert_close(forward(x, activation="relu").cpu(), F.relu(model.fc1(x)).cpu())
    torch.testing.assert_close(forward(x, activation="tanh").cpu(), torch.tanh(model.fc1(x)).cpu())
    forward(x, activation="relu")
    assert forward.traces == 2


@dataclasses.dataclass
class _LossConfig:
    scale: float = 1.0
    activation: str = "tanh"


@pytest.mark.parametrize("how", ["argument", "static_argnames"])
def test_a_config_object_changed_in_place_between_calls(how):
    """A config object passed to the step and changed in place compared equal to itself, so the
    replay kept the first call's settings (a silent wrong answer); its settings are compared by
    value now. An unchanged one records once."""
    torch.manual_seed(0)
    model = MLP().to(DEV)
    cfg = _LossConfig()

    def forward(x, cfg):
        return getattr(torch, cfg.activation)(model.fc1(x)) * cfg.scale

    step = xshard.compile(forward, **({"static_argnames": "cfg"} if how != "argument" else {}))
    x = torch.randn(4, 8).to(DEV)
    for _ in range(3):
        torch.testing.assert_close(step(x, cfg=cfg).cpu(), forward(x, cfg).cpu())
    assert step.traces == 1
    for change in ({"scale": 3.0}, {"activation": "sigmoid"}, {"scale": 1.0}):
        for k, v in change.items():
            setattr(cfg, k, v)
        torch.testing.assert_close(step(x, cfg=cfg).cpu(), forward(x, cfg).cpu())
    assert step.traces == 4 and "('scale', 3.0)" in step.retrace_reasons[0], \
        step.retrace_reasons


def test_a_step_recorded_again_and_again_warns_once_with_the_cause():
    """OneCycleLR cycles AdamW's beta1 on every step, so every call records (and compiles) the
    step again; at the 8th recording one warning names what keeps changing and the fix. The
    values stay right."""
    from compile_testing import train_update

    def run(device, compiled):
        torch.manual_seed(0)
        model = MLP().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=12)
        fn = lambda x, y: train_update(model, opt, x, y)  # noqa: E731
        step = xshard.compile(fn) if compiled else fn
        losses = []
        for x, y in make_batches("mlp", 10):
            losses.append(step(x.to(device), y.to(device)).item())
            sched.step()
        return losses, step

    with pytest.warns(UserWarning, match=r"recorded and compiled the step 8 times.*betas.*"
                                         r"cycle_momentum=False") as record:
        dev, step = run(DEV, True)
    assert sum("recorded and compiled" in str(w.message) for w in record) == 1
    assert step.traces == 10
    torch.testing.assert_close(dev, run("cpu", False)[0], rtol=1e-5, atol=1e-6)


def test_default_dtype_is_part_of_the_guard():
    """A step recorded under float32 as the default dtype made its factories float32 on every
    later call, also after ``torch.set_default_dtype(torch.float64)``."""
    @torch.no_grad()
    def scaled(x):
        return x * torch.full((3,), 1.1, device=x.device)

    step = xshard.compile(scaled)
    x = torch.ones(3, dtype=torch.float64)
    try:
        for dtype in (torch.float32, torch.float64):
            torch.set_default_dtype(dtype)
            torch.testing.assert_close(step(x.to(DEV)).cpu(), scaled(x), rtol=0, atol=0)
    finally:
        torch.set_default_dtype(torch.float32)
    assert step.traces == 2 and "default dtype" in step.retrace_reasons[0]


def test_attribute_a_forward_adds_on_its_first_run_records_once():
    """Attribute counts are taken as the step left them: a forward that caches a setting on its
    module the first time it runs does not record the step a second time."""
    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            if not hasattr(self, "scale"):
                self.scale = 2.0
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    model = Cached().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    step = xshard.compile(squared_output_step(model, opt))
    for _ in range(3):
        step(torch.ones(3, 4).to(DEV))
    assert step.traces == 1, step.retrace_reasons
    del model.scale  # the setting removed: recorded again, and set anew by the forward
    step(torch.ones(3, 4).to(DEV))
    assert step.traces == 2 and "Cached.scale: 2.0 -> (deleted)" in step.retrace_reasons[0]


class _Counting(nn.Module):
    """A forward that changes a Python attribute each call (a counter) or sets it once."""

    def __init__(self, change):
        super().__init__()
        self.lin, self.change, self.steps, self.mode = nn.Linear(4, 2), change, 0, "warmup"

    def forward(self, x):
        if self.change == "counter":
            self.steps += 1
        else:
            self.mode = "steady"
        scale = self.steps + 1 if self.mode == "warmup" else 3.0
        return self.lin(x) * scale


@pytest.mark.parametrize("change", ["counter", "set once"])
def test_python_settings_the_step_changes(change):
    """A setting the step itself changes is compared as it was when the step began, and a replay
    leaves it as the step did: a counter records the step on every call (its Python runs; the
    replay kept the counter at 1, silently), a value set once records twice then replays."""
    def run(device, compiled):
        torch.manual_seed(0)
        model = _Counting(change).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        step = squared_output_step(model, opt)
        step = xshard.compile(step) if compiled else step
        losses = [step(torch.ones(3, 4, device=device)).item() for _ in range(4)]
        return losses, (model.steps, model.mode), step

    dev, cpu = run(DEV, True), run("cpu", False)
    torch.testing.assert_close(dev[0], cpu[0])
    assert dev[1] == cpu[1]
    assert dev[2].traces == (4 if change == "counter" else 2), dev[2].retrace_reasons


def test_an_optimizers_own_python_attribute_is_guarded():
    """An attribute an optimizer's step() reads (``self.scale``), changed between calls, records
    the step again (it was built in, unseen)."""
    class Scaled(torch.optim.SGD):
        scale = 1.0

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.mul_(self.scale)
            return super().step(closure)

    def run(device, compiled):
        torch.manual_seed(0)
        model = nn.Linear(4, 2).to(device)
        opt = Scaled(model.parameters(), lr=0.1)
        opt.scale = 1.0
        step = squared_output_step(model, opt)
        step = xshard.compile(step) if compiled else step
        losses = []
        for i in range(4):
            if i == 2:
                opt.scale = 0.0
            losses.append(step(torch.ones(3, 4, device=device)).item())
        return losses, step

    dev = run(DEV, True)
    torch.testing.assert_close(dev[0], run("cpu", False)[0])
    assert dev[1].traces == 2 and "Scaled.scale: 1.0 -> 0.0" in dev[1].retrace_reasons[0]

