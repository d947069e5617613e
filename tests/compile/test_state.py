"""What a compiled step reads and writes: the random stream, gradients left by the step, values it
returns, state that another tensor shares, arguments it changes."""

import pytest
import torch
import torch.nn.functional as F

import xshard
import xshard.spmd as xs
from xshard.step.errors import StateError
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


def test_replay_executable_draws_as_the_host_counter_wraps(monkeypatch):
    """The replay executable reads the stream's numbers from one (seed, counter) array: a draw's
    counter wraps past 2**64 as the host's does, and every mask equals the lazy path's."""
    from xshard.core import rng
    from xshard.step import packing

    monkeypatch.setattr(packing, "MIN_PACKED", 1)  # a replay executable for this small step
    x = torch.ones(64, 32).to(DEV)

    def two_draws(x):
        return F.dropout(x, 0.5), F.dropout(x * 3, 0.25)

    drop = xshard.compile(two_draws)
    last = (1 << 64) - 1  # draws at 2**64 - 1 and 0: recorded, then replayed so
    for counter in (last, 5, last - 2, last):
        rng.set_position(7, counter)
        compiled = [t.cpu() for t in drop(x)]
        rng.set_position(7, counter)
        lazy = [t.cpu() for t in two_draws(x)]
        assert all(torch.equal(a, b) for a, b in zip(compiled, lazy))
        assert rng.position() == (7, (counter + 2) % (1 << 64))
    assert drop.traces == 1 and drop._last.packed.stream


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
    # Replayed by the replay executable, with the constants built in and the stream's numbers
    # read from one array (see [Note: numbers built into a replay] in xshard/step/packing.py).
    replay = step._last.packed
    assert replay.fixed and len(replay.stream) == 8
    assert len(step._last.compiled.input_shardings[0]) == len(replay.layouts) + len(
        replay.inputs) + 1


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
    # The same masks (other masks change a loss by ~1e-2); the two programs may round an op
    # apart (1 ulp).
    assert losses[1] == pytest.approx(losses[0], rel=1e-6, abs=0)
    assert step.traces == 2


def _write_a_read_b(a, b):
    a.add_(1.0)
    return b.sum()


def test_arguments_sharing_a_storage_are_part_of_the_key():
    """One tensor passed twice: the write through one argument is seen through the other, as in
    eager; a program recorded for distinct tensors is not replayed for one passed twice (it was,
    and returned 0 where eager gives 4), nor the reverse."""
    step = xshard.compile(_write_a_read_b)
    for aliased, want in [(False, 0.0), (True, 4.0), (False, 0.0), (True, 4.0)]:
        x = torch.zeros(4, device=DEV)
        assert step(x, x if aliased else x.clone()).item() == want
        assert x.tolist() == [1.0] * 4
    assert step.traces == 2, step.retrace_reasons
    assert "arguments sharing a storage" in step.retrace_reasons[0]


def test_argument_sharing_a_parameters_storage_is_guarded():
    """An argument that is a parameter's storage (``m.weight.detach()``) in some calls and a
    separate tensor in others: each call's program is the one recorded for its pattern."""
    def run(device, compiled):
        model = torch.nn.Linear(2, 2, bias=False).to(device)
        with torch.no_grad():
            model.weight.zero_()

        def write_argument_read_weight(a):
            a.add_(1.0)
            return model.weight.sum() * 1.0

        step = xshard.compile(write_argument_read_weight) if compiled else \
            write_argument_read_weight
        outs = [step(model.weight.detach() if alias else torch.zeros(2, 2, device=device)).item()
                for alias in [False, True, False, True]]
        return outs, step

    dev, step = run(DEV, True)
    assert dev == run("cpu", False)[0] == [0.0, 4.0, 4.0, 8.0]
    assert step.traces == 2, step.retrace_reasons
    assert "shares its storage with nothing -> model.weight" in step.retrace_reasons[0]


def test_written_view_argument_is_refused_and_read_views_work():
    """A view argument is taken as a copy: a step writing it (or the tensor it views) is refused
    with the fix, the state left as it was (the write used to be lost, silently); a view the step
    only reads works."""
    step = xshard.compile(_write_a_read_b)
    x = torch.arange(8.0, device=DEV)
    with pytest.raises(StateError, match=r"argument 1 is a view of another tensor.*v.copy_\(y\)"):
        step(x, x[1:3])
    with pytest.raises(StateError, match=r"argument 0 is a view"):
        step(x[1:3], torch.ones(2, device=DEV))
    assert x.tolist() == list(range(8))
    assert _write_a_read_b(x[1:3], x[1:3]).item() == 5.0  # the lazy path still runs it
    y = torch.ones(4, device=DEV)
    read_only = xshard.compile(lambda a, b: a.add_(b.sum()))
    read_only(y, x[2:4])
    read_only(y, x[4:6])
    assert y.tolist() == [16.0] * 4  # 1 + (3 + 3) + (4 + 5): x[1:3] was written above


def test_written_cpu_argument_is_refused_and_read_ones_work():
    """A CPU tensor argument is moved to the device: a step writing it (a counter) is refused
    with the fix (the write was lost, silently: the counter stayed 0); one it reads works."""
    def count_calls(x, count):
        count += 1
        return x * 2

    step = xshard.compile(count_calls)
    x, count = torch.ones(2, device=DEV), torch.zeros((), dtype=torch.int64)
    with pytest.raises(StateError, match=r"argument 1 is a CPU tensor and the step writes it in "
                                         r"place.*t.to\(xshard.device\(\)\)"):
        step(x, count)
    assert count.item() == 0
    on_device = count.to(DEV)
    for _ in range(3):
        step(x, on_device)
    assert on_device.item() == 3
    scale = xshard.compile(lambda a, w: a * w)
    assert scale(x, torch.tensor([2.0, 3.0])).tolist() == [2.0, 3.0]
    assert scale(x, torch.tensor([4.0, 5.0])).tolist() == [4.0, 5.0]


@pytest.mark.parametrize("when", ["before the first call", "between calls"])
def test_parameters_viewing_one_flat_vector_are_refused(when):
    """Parameters made views of one vector (vector_to_parameters) and updated by the step: a
    clear error, the state left as it was, and the lazy path runs on (the replay replaced each
    parameter with a plain tensor, or left donated arrays that broke every later sync)."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    def run(device, compiled):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 2)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def train_step(x):
            return train_update(lambda v: model(v).pow(2).mean(), opt, x)

        step = xshard.compile(train_step) if compiled else train_step
        x, losses = torch.ones(3, 4, device=device), []
        for i in range(4):
            if i == (0 if when == "before the first call" else 2):
                vector_to_parameters(parameters_to_vector(model.parameters()) * 0.9,
                                     model.parameters())
            try:
                losses.append(step(x).item())
            except StateError as e:
                assert "is a view of a storage no other state holds" in str(e)
                losses.append(train_step(x).item())
        return losses, [p.detach().cpu() for p in model.parameters()]

    dev = run(DEV, True)
    assert all(isinstance(p, torch.Tensor) for p in dev[1])
    torch.testing.assert_close(dev, run("cpu", False), rtol=1e-5, atol=1e-6)

