"""CPU tensors a compiled step reads (see [Note: host tensors a step reads] in xshard/step/host.py):
a loss weight in the closure, a module's plain tensor attribute, Adam's betas given as tensors.
Changed in place or replaced between calls, each compiled call computes what eager CPU PyTorch
does; before, the replay kept the values of the recording (a silent wrong answer). A step that
writes a CPU tensor outliving it is refused."""

import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xshard
from compile_testing import DEV, MLP, assert_same_run, make_batches, train_update
from xshard.step import host
from xshard.step.errors import CaptureError


class _Tempered(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.temperature = torch.tensor(1.0)  # a plain attribute: .to(device) leaves it on the CPU

    def forward(self, x, y):
        return F.cross_entropy(self.fc(x) / self.temperature.to(x.device), y)


def _run(device, compiled, change, steps=5):
    """``steps`` SGD steps; before the third, ``change(model, scale, opt)`` runs."""
    torch.manual_seed(0)
    model = _Tempered().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = torch.tensor(1.0)

    def train_step(x, y):
        return train_update(lambda x, y: model(x, y) * scale.to(x.device), opt, x, y)

    step = xshard.compile(train_step) if compiled else train_step
    losses = []
    for i, (x, y) in enumerate(make_batches("mlp", steps)):
        if i == 2:
            change(model, scale, opt)
        losses.append(step(x.to(device), y.to(device)).item())
    return losses, [p.detach().cpu() for p in model.parameters()], step


CHANGES = {
    "closure tensor written": lambda m, s, o: s.fill_(2.5),
    "closure tensor written through a view": lambda m, s, o: s.view(1).mul_(3.0),
    "attribute written": lambda m, s, o: m.temperature.copy_(torch.tensor(0.5)),
    "attribute replaced": lambda m, s, o: setattr(m, "temperature", torch.tensor(4.0)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_host_tensor_changed_between_calls(change):
    cpu, dev = _run("cpu", False, CHANGES[change]), _run(DEV, True, CHANGES[change])
    assert_same_run(cpu, dev)
    assert dev[2].traces == 2
    assert "CPU tensor of shape []" in dev[2].retrace_reasons[0]


def test_unchanged_host_tensors_record_once():
    cpu, dev = _run("cpu", False, lambda m, s, o: None), _run(DEV, True, lambda m, s, o: None)
    assert_same_run(cpu, dev)
    assert dev[2].traces == 1


def test_adam_tensor_betas_changed_in_place():
    """torch.optim accepts tensor betas (in its for-loop form); a schedule that changes them in
    place (``1 - beta1`` is computed on the CPU inside the step) is seen on the next call."""
    def run(device, compiled):
        torch.manual_seed(0)
        model = MLP().to(device)
        beta1, beta2 = torch.tensor(0.9), torch.tensor(0.999)
        opt = torch.optim.Adam(model.parameters(), lr=0.05, betas=(beta1, beta2), foreach=False)
        fn = lambda x, y: train_update(model, opt, x, y)  # noqa: E731
        step = xshard.compile(fn) if compiled else fn
        losses = []
        for i, (x, y) in enumerate(make_batches("mlp", 5)):
            if i == 3:
                beta1.fill_(0.5)
            losses.append(step(x.to(device), y.to(device)).item())
        return losses, [p.detach().cpu() for p in model.parameters()], step

    cpu, dev = run("cpu", False), run(DEV, True)
    assert_same_run(cpu, dev)
    assert any("CPU tensor" in r for r in dev[2].retrace_reasons)


def test_step_writing_a_host_tensor_is_refused():
    torch.manual_seed(0)
    model = MLP().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = torch.zeros(())
    before = [p.detach().cpu() for p in model.parameters()]

    def train_step(x, y):
        calls.add_(1)  # a CPU counter: a replay would not count
        return train_update(model, opt, x, y)

    step = xshard.compile(train_step)
    x, y = make_batches("mlp", 1)[0]
    with pytest.raises(CaptureError, match=r"writes a CPU tensor of shape \[\].*test_host_"):
        step(x.to(DEV), y.to(DEV))
    for a, b in zip(before, model.parameters()):  # the refusal left the state as it was
        torch.testing.assert_close(b.detach().cpu(), a, rtol=0, atol=0)


def test_host_tensors_made_inside_the_step_need_no_guard():
    """CPU tensors created (and written) inside the step are constants of its code."""
    def run(device, compiled):
        torch.manual_seed(0)
        model = MLP().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_step(x, y):
            weights = torch.ones(4)
            weights[1] = 2.0
            loss = F.cross_entropy(model.fc2(torch.tanh(model.fc1(x))), y,
                                   weight=weights.to(x.device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        step = xshard.compile(train_step) if compiled else train_step
        losses = [step(x.to(device), y.to(device)).item() for x, y in make_batches("mlp", 4)]
        return losses, [p.detach().cpu() for p in model.parameters()], step

    cpu, dev = run("cpu", False), run(DEV, True)
    assert_same_run(cpu, dev)
    assert dev[2].traces == 1


def test_host_tensor_under_a_freed_tensors_id_is_noted():
    """A tensor whose id a tensor freed earlier in the recording had (ids are reused) is noted
    afresh: before, it went unnoticed, and a write to it was not refused."""
    reads = host.HostReads()
    counter = torch.zeros(())
    freed = torch.ones(())
    reads.seen[id(counter)] = (weakref.ref(freed), 0, ())  # as if `freed` had had this id
    del freed
    with reads:
        counter.add_(1)
    with pytest.raises(CaptureError, match=r"writes a CPU tensor of shape \[\]"):
        reads.guarded("step")
