"""Shared models, optimizers and runners for the xshard.compile tests: the lazy path is the oracle
(itself checked against eager CPU PyTorch by tests/core), compared step by step."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import xshard
from xshard.models import GPT, GPTConfig, ResNet, ResNetConfig

DEV = xshard.device()
STEPS = 10
TOL = dict(rtol=2e-5, atol=2e-6)

GPT_TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0,
                     bias=False)
RESNET_TINY = ResNetConfig(depths=(1, 1), widths=(4, 8), expansion=2, stem_width=4,
                           num_classes=5)

# Adam's eps=1e-6 for the reason given in tests/fsdp/fsdp_testing.py (a gradient that cancels to
# float32 noise would otherwise take a full-size step whose sign is that noise).
OPTIMIZERS = {
    "sgd": lambda p, fe: torch.optim.SGD(p, lr=0.05, foreach=fe),
    "sgd_momentum": lambda p, fe: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                                  weight_decay=1e-2, foreach=fe),
    "adam": lambda p, fe: torch.optim.Adam(p, lr=1e-2, eps=1e-6, foreach=fe),
    "adamw": lambda p, fe: torch.optim.AdamW(p, lr=1e-2, eps=1e-6, weight_decay=0.1,
                                             foreach=fe),
}


class MLP(nn.Module):
    def __init__(self, d_in=8, hidden=16, classes=4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, classes)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(torch.tanh(self.fc1(x))), y)


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP()
    if kind == "cnn":
        return ResNet(RESNET_TINY)
    if kind == "gpt":
        return GPT(GPT_TINY)
    raise ValueError(kind)


def make_batches(kind: str, n: int = STEPS, batch: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if kind == "mlp":
            out.append((torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,),
                                                                          generator=g)))
        elif kind == "cnn":
            out.append((torch.randn(batch, 3, 16, 16, generator=g),
                        torch.randint(0, 5, (batch,), generator=g)))
        else:
            v, t = GPT_TINY.vocab_size, GPT_TINY.block_size
            out.append((torch.randint(0, v, (batch, t), generator=g),
                        torch.randint(0, v, (batch, t), generator=g)))
    return out


def scheduler(opt):
    """Changes the learning rate every step (so a baked-in rate would show)."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + 0.3 * i))


def train_lazy(model, opt, data, sched=None, place=None):
    losses = []
    for x, y in data:
        x, y = (place or _to_dev)(x, y)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        xshard.sync()
        losses.append(loss.item())
        if sched is not None:
            sched.step()
    return losses


def train_update(model, opt, *batch):
    """One plain training step: forward (the model returns the loss), backward, update."""
    loss = model(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def assert_same_run(cpu, dev) -> None:
    """Two runs' losses (item 0) and parameters (item 1) agree: eager CPU and compiled."""
    torch.testing.assert_close(dev[0], cpu[0], rtol=1e-5, atol=1e-6)
    assert len(dev[1]) == len(cpu[1])
    for a, b in zip(cpu[1], dev[1]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def squared_output_step(model, opt):
    """A training step whose loss is the mean square of ``model(x)`` (for models that return
    their output, not a loss)."""
    def train_step(x):
        return train_update(lambda v: model(v).pow(2).mean(), opt, x)

    return train_step


def compiled_step(model, opt):
    def train_step(x, y):
        return train_update(model, opt, x, y)

    return xshard.compile(train_step)


def train_compiled(step, data, sched=None, place=None):
    losses = []
    for x, y in data:
        x, y = (place or _to_dev)(x, y)
        losses.append(step(x, y).item())
        if sched is not None:
            sched.step()
    return losses


def _to_dev(x, y):
    return x.to(DEV), y.to(DEV)


def assert_models_close(a: nn.Module, b: nn.Module, **tol):
    tol = tol or TOL
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p.cpu(), q.cpu(), msg=lambda m: f"{name}: {m}", **tol)


def assert_state_close(opt_a, opt_b, **tol):
    tol = tol or TOL
    for (p, sa), sb in zip(opt_a.state.items(), opt_b.state.values()):
        for k, v in sa.items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(v.cpu().to(sb[k].dtype), sb[k].cpu(),
                                           msg=lambda m: f"state {k}: {m}", **tol)


def twins(kind: str, opt_name: str, foreach, wrap=None):
    """Two identical (model, optimizer) pairs on the device, built by ``wrap`` if given."""
    base = make_model(kind)
    pairs = []
    for _ in range(2):
        model = copy.deepcopy(base)
        model = wrap(model) if wrap is not None else model.to(DEV)
        pairs.append((model, OPTIMIZERS[opt_name](model.parameters(), foreach)))
    return pairs

