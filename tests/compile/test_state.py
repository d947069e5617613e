"""What a compiled step reads and writes: the random stream, gradients left by the step, values it
returns, state that another tensor shares, arguments it changes."""

import pytest
import torch
import torch.nn.functional as F

import xshard
import xshard.spmd as xs
from compile_testing import (DEV, MLP, TOL, assert_models_close, compiled_step, make_batches,
                             train_compiled, train_lazy, train_update, twins)
from xshard.mesh import Mesh


def test_dropout_masks_differ_between_calls_and_follow_the_seed():
    x = torch.ones(64, 32).to(DEV)

    @xshard.compile
    def drop(x):
        return F.dropout(x, 0.5)

    torch.manual_seed(0)
    masks = [drop(x).cpu() for _ in range(4)]
    assert drop.traces == 1
    assert all(not torch.equal(masks[i], masks[j]) for i in range(4) for j in range(i))
    # The same draws as the lazy path from the same seed, and again after reseeding.
    torch.manual_seed(0)
    lazy = [F.dropout(x, 0.5).cpu() for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(masks, lazy))
    torch.manual_seed(0)
    assert torch.equal(drop(x).cpu(), masks[0])
    assert drop.traces == 1


def test_dropout_in_a_training_step_matches_the_lazy_path():
    from xshard.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.2)
    data = [(torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))) for _ in range(4)]
    losses = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg).to(DEV)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = compiled_step(model, opt)
        run_step = step if compiled else step.fn  # .fn: the same function, run lazily
        torch.manual_seed(1)
        run = [float(run_step(x.to(DEV), y.to(DEV)).item()) for x, y in data]
        losses.append(run)
    assert losses[0] == losses[1]
    assert step.traces == 1


def test_gradients_left_by_the_step_are_updated():
    """zero_grad first: the step leaves this step's gradients in .grad, as the lazy path does."""
    data = make_batches("mlp", 4)
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = MLP().to(DEV)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_step(x, y):
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            opt.step()
            return loss

        step = xshard.compile(train_step) if compiled else train_step
        for x, y in data:
            step(x.to(DEV), y.to(DEV))
        grads.append([p.grad.cpu() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert step.traces == 2  # .grad is None at the first call, a tensor after it


def test_returns_any_structure():
    torch.manual_seed(0)
    model = MLP().to(DEV)

    @xshard.compile
    def evaluate(x, y):
        h = model.fc1(x)
        return {"loss": model(x, y), "stats": (h.mean(), h.shape[0]), "name": "mlp",
                "weight": model.fc1.weight}

    x, y = (t.to(DEV) for t in make_batches("mlp", 1)[0])
    for _ in range(2):
        out = evaluate(x, y)
        assert out["name"] == "mlp" and out["stats"][1] == 8
        assert out["weight"] is model.fc1.weight  # state comes back as itself
        torch.testing.assert_close(out["loss"].cpu(), model(x, y).cpu())
        torch.testing.assert_close(out["stats"][0].cpu(), model.fc1(x).mean().cpu())
    assert evaluate.traces == 1


def test_state_shared_with_another_tensor_is_not_consumed():
    """A tensor sharing a parameter's data (ema.copy_(p), lazily) keeps its value: the step
    consumes a copy of that parameter's buffer, not the shared one."""
    torch.manual_seed(0)
    model = MLP().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @xshard.compile
    def train_step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    data = make_batches("mlp", 3)
    train_step(*(t.to(DEV) for t in data[0]))
    ema = [torch.zeros_like(p) for p in model.parameters()]
    with torch.no_grad():
        for e, p in zip(ema, model.parameters()):
            e.copy_(p)
    expected = [p.cpu() for p in model.parameters()]
    train_step(*(t.to(DEV) for t in data[1]))
    train_step(*(t.to(DEV) for t in data[2]))
    for e, want in zip(ema, expected):
        torch.testing.assert_close(e.cpu(), want, rtol=0, atol=0)
    assert train_step.traces == 1


def test_argument_sharded_inside_the_step():
    """mark_sharding of an argument inside the step is part of the program: each call's argument
    ends up sharded, and the result equals the lazy path's."""
    mesh = Mesh(range(8), (8,), ("data",))
    torch.manual_seed(0)
    model = MLP().to(DEV)

    @xshard.compile
    def forward(x, y):
        xs.mark_sharding(x, mesh, ("data", None))
        return model(x, y)

    for x, y in make_batches("mlp", 2):
        xd, yd = x.to(DEV), y.to(DEV)
        loss = forward(xd, yd)
        assert xs.get_sharding_spec(xd) == "{devices=[8,1]0,1,2,3,4,5,6,7}"
        torch.testing.assert_close(loss.cpu(), model(x.to(DEV), y.to(DEV)).cpu())
    assert forward.traces == 1


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_state_on_a_sub_mesh(kind):
    """Parameters sharded over 4 of the 8 devices; the batch and the BatchNorm buffers are
    unannotated (replicated over all 8): each call lays them out on the parameters' devices, as a
    lazy step does. (A replay passed them as they were, and jax refused the second call.)"""
    mesh = Mesh([4, 5, 6, 7], (4,), ("fsdp",))

    def wrap(model):
        model = model.to(DEV)
        for p in model.parameters():
            if p.shape[0] % 4 == 0:
                xs.mark_sharding(p, mesh, ("fsdp",) + (None,) * (p.dim() - 1))
        return model

    (m_lazy, o_lazy), (m_step, o_step) = twins(kind, "sgd_momentum", False, wrap)
    data = make_batches(kind, 4)
    want = train_lazy(m_lazy, o_lazy, data)
    step = compiled_step(m_step, o_step)
    torch.testing.assert_close(train_compiled(step, data), want, **TOL)
    assert_models_close(m_lazy, m_step)
    assert step.traces == 2  # the second call reads the momentum buffers the first one made
    weight = next(p for p in m_step.parameters() if p.shape[0] % 4 == 0)
    assert xs.get_sharding_spec(weight).endswith("4,5,6,7}")


def test_host_tensors_are_moved():
    torch.manual_seed(0)
    model = MLP().to(DEV)

    @xshard.compile
    def forward(x, y):
        return model(x.to(DEV), y.to(DEV))

    for x, y in make_batches("mlp", 3):
        torch.testing.assert_close(forward(x, y).cpu(), model(x.to(DEV), y.to(DEV)).cpu())
    assert forward.traces == 1


@pytest.mark.parametrize("where", ["argument", "closure"])
def test_state_found_from_arguments_or_closure(where):
    torch.manual_seed(0)
    model = MLP().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    step = xshard.compile(train_update)
    data = make_batches("mlp", 3)
    before = model.fc1.weight.cpu()
    for x, y in data:
        if where == "argument":
            step(model, opt, x.to(DEV), y.to(DEV))
        else:
            xshard.compile(lambda x, y: train_update(model, opt, x, y))(x.to(DEV), y.to(DEV))
    assert not torch.equal(model.fc1.weight.cpu(), before)


def test_checkpointed_fsdp_units_with_dropout():
    """Activation checkpointing saves and restores the random stream around the recomputation;
    inside a recording that is the key's node, not its value: the same losses as the lazy path."""
    import copy
    import functools

    from xshard.fsdp import FSDP, checkpoint_module, transformer_auto_wrap_policy
    from xshard.models import GPT, GPTConfig
    from xshard.models.gpt import Block
    from xshard.step.optim import make_capturable

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.2)
    torch.manual_seed(0)
    base = GPT(cfg)
    data = [(torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))) for _ in range(3)]
    losses = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        checkpoint_module(model.blocks[0])
        model = FSDP(model, auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={Block}))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        make_capturable([opt])  # the same optimizer arithmetic on both sides
        step = compiled_step(model, opt)
        run_step = step if compiled else step.fn
        torch.manual_seed(1)
        losses.append([float(run_step(x.to(DEV), y.to(DEV)).item()) for x, y in data])
    assert losses[0] == losses[1]
    assert step.traces == 2
