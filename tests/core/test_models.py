"""Whole models trained several steps on xshard equal eager CPU, with no CPU fallback, compiling once
for the steady state: an MLP, a CNN (BatchNorm in train and eval mode, pooling) and a GPT."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xshard
from core_testing import DEV, assert_same, counting
from xshard.models.gpt import GPT, GPTConfig

TOL = dict(rtol=2e-4, atol=2e-5)


def train(model, opt, batches, loss_fn, device, sync=False):
    losses = []
    for x, y in batches:
        loss = loss_fn(model(to(x, device)), to(y, device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sync:
            xshard.sync()
        losses.append(loss.detach())
    return losses


def to(x, device):
    if isinstance(x, tuple):
        return tuple(v.to(device) for v in x)
    return x if x is None else x.to(device)


def run_both(make_model, make_opt, batches, loss_fn, warmup=2):
    """Trains a CPU copy and a device copy; returns (cpu model, device model, per-step metrics)."""
    torch.manual_seed(0)
    ref = make_model()
    model = copy.deepcopy(ref).to(DEV)
    ref_losses = train(ref, make_opt(ref), batches, loss_fn, "cpu")
    opt = make_opt(model)
    with counting() as first:
        losses = train(model, opt, batches[:warmup], loss_fn, DEV, sync=True)
    with counting() as steady:
        losses += train(model, opt, batches[warmup:], loss_fn, DEV, sync=True)
    assert_same(losses, ref_losses, **TOL)
    return ref, model, first, steady


def assert_params_equal(model, ref, **tol):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.device == DEV, name
        assert_same(p, q, **(tol or TOL))
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert_same(b, c, **(tol or TOL))


def test_mlp():
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g))
               for _ in range(5)]
    ref, model, first, steady = run_both(
        lambda: nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(),
                              nn.Dropout(0.0), nn.Linear(64, 5)),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), batches,
        F.cross_entropy)
    assert first["cpu_fallbacks"] == {} and steady["cpu_fallbacks"] == {}
    assert first["compiles"] <= 2
    assert steady["compiles"] == 0 and steady["executions"] == 3
    assert_params_equal(model, ref)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.conv3 = nn.Conv2d(16, 16, 3, padding=1, groups=2)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.avg_pool2d(F.gelu(self.bn2(self.conv2(x))), 2)
        x = F.silu(self.conv3(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


def cnn_batches(n):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 4, (4,), generator=g))
            for _ in range(n)]


def test_cnn_train_mode_with_batchnorm_running_stats():
    ref, model, first, steady = run_both(
        CNN, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), cnn_batches(4),
        F.cross_entropy)
    assert first["cpu_fallbacks"] == {} and steady["cpu_fallbacks"] == {}
    assert first["compiles"] <= 2
    assert steady["compiles"] == 0 and steady["executions"] == 2
    assert_params_equal(model, ref, rtol=1e-3, atol=1e-4)
    assert model.bn1.num_batches_tracked.item() == 4
    assert_same(model.bn1.running_mean, ref.bn1.running_mean, rtol=1e-4, atol=1e-5)
    assert_same(model.bn2.running_var, ref.bn2.running_var, rtol=1e-4, atol=1e-5)


def test_cnn_eval_mode_uses_running_stats():
    torch.manual_seed(0)
    ref = CNN()
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), cnn_batches(2), F.cross_entropy, "cpu")
    model = copy.deepcopy(ref).to(DEV)
    ref.eval()
    model.eval()
    x = cnn_batches(3)[2][0]
    with counting() as d:
        with torch.no_grad():
            out = model(x.to(DEV))
        running = model.bn1.running_mean.clone()
        xshard.sync()
    assert d["cpu_fallbacks"] == {} and d["executions"] == 1
    with torch.no_grad():
        assert_same(out, ref(x), **TOL)
    assert_same(running, ref.bn1.running_mean)  # eval mode does not update the statistics
    # Gradients through eval-mode BatchNorm, too.
    model(x.to(DEV)).sum().backward()
    ref(x).sum().backward()
    assert_same(model.conv1.weight.grad, ref.conv1.weight.grad, rtol=1e-3, atol=1e-4)


def gpt_batches(cfg, n, batch=2, t=16):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        idx = torch.randint(0, cfg.vocab_size, (batch, t + 1), generator=g)
        targets = idx[:, 1:].clone()
        targets[0, :3] = -100  # ignored positions
        out.append((idx[:, :-1].contiguous(), targets))
    return out


class GPTWithTargets(nn.Module):
    """GPT computing its own loss (cross_entropy with ignore_index) from an (idx, targets) pair."""

    def __init__(self, cfg):
        super().__init__()
        self.gpt = GPT(cfg)

    def forward(self, idx_targets):
        idx, targets = idx_targets
        return self.gpt(idx, targets)


def test_gpt_trains_like_eager():
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
    batches = gpt_batches(cfg, 4)
    ref, model, first, steady = run_both(
        lambda: GPTWithTargets(cfg),
        lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1),
        [((idx, targets), None) for idx, targets in batches], lambda loss, _: loss)
    ref, model = ref.gpt, model.gpt
    assert first["cpu_fallbacks"] == {} and steady["cpu_fallbacks"] == {}
    assert first["compiles"] <= 2
    assert steady["compiles"] == 0 and steady["executions"] == 2
    assert model.lm_head.weight is model.wte.weight  # tied embeddings stay one parameter
    # AdamW moves a weight with a near-zero gradient by about lr whatever the gradient's rounding,
    # so a few such weights may differ by a fraction of lr (3e-3) in float32.
    assert_params_equal(model, ref, rtol=1e-3, atol=5e-4)


def test_gpt_with_dropout_runs_without_fallback_or_recompiles():
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=1, n_head=4, n_embd=32, dropout=0.1)
    torch.manual_seed(0)
    model = GPT(cfg).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    batches = gpt_batches(cfg, 3)
    metrics_per_step, losses = [], []
    for idx, targets in batches:
        with counting() as d:
            loss = model(idx.to(DEV), targets.to(DEV))
            loss.backward()
            opt.step()
            opt.zero_grad()
            xshard.sync()
        metrics_per_step.append(d)
        losses.append(loss.item())
    assert all(d["cpu_fallbacks"] == {} for d in metrics_per_step)
    assert metrics_per_step[0]["compiles"] == 1
    assert sum(d["compiles"] for d in metrics_per_step[1:]) == 0
    assert all(torch.isfinite(torch.tensor(losses)))
    # (A new dropout mask each step from one executable: see test_random.py.)


def test_gpt_logits_and_generation_step():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    ref = GPT(cfg).eval()
    model = copy.deepcopy(ref).to(DEV)
    idx = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        logits = model(idx.to(DEV))
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        grown = torch.cat([idx.to(DEV), nxt], 1)
        ref_logits = ref(idx)
    assert_same(logits, ref_logits, **TOL)
    assert_same(grown, torch.cat([idx, ref_logits[:, -1].argmax(-1, keepdim=True)], 1))
