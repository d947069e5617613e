"""What xshard.compile refuses, with a message naming the op or the user's line; the state is left
as it was, and the same function still runs on the lazy path."""

import copy
import dataclasses
import random
import types

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

import xshard
from compile_testing import DEV, MLP, make_batches
from xshard.step import CaptureError, CompileError, StateError


@pytest.fixture
def trained():
    torch.manual_seed(0)
    model = MLP().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = (t.to(DEV) for t in make_batches("mlp", 1)[0])
    return model, opt, x, y


def item_inside(model, opt, x, y):
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"loss {loss.item():.3f}")  # the offending line
    return loss


def branch_on_value(model, opt, x, y):
    loss = model(x, y)
    if loss > 1:  # the offending line
        loss = loss * 2
    return loss


def print_tensor(model, opt, x, y):
    h = model.fc1(x)
    print(h)  # the offending line
    return model(x, y)


def op_without_rule(model, opt, x, y):
    h = model.fc1(x)
    return torch.linalg.eigvals(h[:4, :4])  # the offending line


def cpu_read(model, opt, x, y):
    return model(x, y).cpu()  # the offending line


@pytest.mark.parametrize("fn,match", [
    (item_inside, r"reading a tensor's value .* at .*test_compile_errors.py:\d+: print\(f\"loss"),
    (branch_on_value, r"reading a tensor's value .* at .*test_compile_errors.py:\d+: if loss > 1:"),
    (print_tensor, r"reading a tensor's value .* at .*test_compile_errors.py:\d+: print\(h\)"),
    (op_without_rule, r"aten.linalg_eig.default has no lowering rule \(at .*test_compile_errors.py:\d+"),
    (cpu_read, r"reading a tensor's value .* at .*test_compile_errors.py:\d+: return model\(x, y\).cpu"),
], ids=["item", "branch", "print", "no_rule", "cpu"])
def test_refused_and_lazy_path_still_works(trained, fn, match):
    model, opt, x, y = trained
    before = [p.cpu() for p in model.parameters()]
    with pytest.raises(CaptureError, match=match):
        xshard.compile(fn)(model, opt, x, y)
    # Nothing changed: parameters, gradients, optimizer state.
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.cpu(), b)
        assert p.grad is None
    assert len(opt.state) == 0
    # The lazy path runs the same function (the CPU op through its fallback).
    with pytest.warns(UserWarning) if fn is op_without_rule else _nothing():
        out = fn(model, opt, x, y)
    xshard.sync()
    assert torch.isfinite(torch.as_tensor(out.cpu() if hasattr(out, "cpu") else out)).all()


def test_a_read_inside_a_library_names_the_library_line_too():
    """BatchNorm with momentum=None reads its batch count as a number in its forward: the error
    names the user's line and BatchNorm's."""
    bn = torch.nn.BatchNorm1d(8, momentum=None).to(DEV)

    def step(x):
        return bn(x).sum()  # the user's line

    with pytest.raises(CaptureError, match=r"test_compile_errors.py:\d+: return bn\(x\).sum\(\).* "
                                           r"\(inside torch/nn/modules/batchnorm.py:\d+: .*"
                                           r"float\(self.num_batches_tracked\)"):
        xshard.compile(step)(torch.randn(4, 8).to(DEV))
    assert int(bn.num_batches_tracked.cpu()) == 0  # nothing ran
    step(torch.randn(4, 8).to(DEV))  # the lazy path
    assert int(bn.num_batches_tracked.cpu()) == 1


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_returned_object_hiding_tensors_is_refused(trained):
    """A dataclass pytree does not know: every call returned the first call's object (its loss
    then unreadable); refused with the fix, the state as it was. Registered, it is a pytree."""
    model, opt, x, y = trained

    @dataclasses.dataclass
    class Result:
        loss: torch.Tensor
        step: int

    def train(model, opt, x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return Result(loss, 1)

    before = [p.cpu() for p in model.parameters()]
    with pytest.raises(CaptureError, match=r"returns a Result holding device tensors \(loss\).*"
                                           r"register_dataclass"):
        xshard.compile(train)(model, opt, x, y)
    assert all(torch.equal(p.cpu(), b) for p, b in zip(model.parameters(), before))
    assert len(opt.state) == 0
    pytree.register_dataclass(Result)
    try:
        step = xshard.compile(train)
        losses = [step(model, opt, x, y) for _ in range(3)]
        assert len({id(r) for r in losses}) == 3 and losses[0].loss.item() > losses[2].loss.item()
    finally:
        pytree._deregister_pytree_node(Result)


def test_scheduler_inside_the_step(trained):
    model, opt, x, y = trained
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        return loss

    with pytest.raises(StateError, match=r"changed the learning rate of param group 0 .*call "
                                         r"scheduler.step\(\) outside it"):
        xshard.compile(step)(x, y)
    assert opt.param_groups[0]["lr"] != opt.param_groups[0]["lr"] * 2  # a float again
    assert isinstance(opt.param_groups[0]["lr"], float)


def test_hyperparameter_changed_inside_the_step(trained):
    model, opt, x, y = trained

    def step(x, y):
        opt.param_groups[0]["momentum"] = 0.5
        return model(x, y)

    with pytest.raises(StateError, match=r"changed optimizer param_groups\[0\]\['momentum'\] "
                                         r"from 0.9 to 0.5"):
        xshard.compile(step)(x, y)


def test_tensor_kept_outside_the_step(trained):
    model, opt, x, y = trained
    kept = []

    @xshard.compile
    def step(x, y):
        h = model.fc1(x)
        kept.append(h * 2)  # neither state nor a result
        return model(x, y)

    with pytest.warns(UserWarning, match=r"keeps 1 tensor\(s\) it computed outside the model, "
                                         r"optimizer and return value \(shapes \[8, 16\]\)"):
        step(x, y)
    with pytest.raises(StateError, match="kept outside the step's model, optimizer and return "
                                         "value"):
        kept[0].cpu()


def test_compiled_step_inside_another(trained):
    model, opt, x, y = trained
    inner = xshard.compile(lambda x, y: model(x, y))

    with pytest.raises(CompileError, match="called inside another compiled step"):
        xshard.compile(lambda x, y: inner(x, y))(x, y)


def test_bad_arguments():
    with pytest.raises(TypeError, match="xshard.compile needs a callable"):
        xshard.compile(3)
    with pytest.raises(TypeError, match="static_argnums must be non-negative ints"):
        xshard.compile(lambda x: x, static_argnums=(-1,))
    with pytest.raises(TypeError, match="static_argnames must be keyword-argument names"):
        xshard.compile(lambda x: x, static_argnames=(1,))


def test_sync_inside_is_a_no_op(trained):
    model, opt, x, y = trained

    @xshard.compile
    def step(x, y):
        loss = model(x, y)
        xshard.sync()
        return loss

    with pytest.warns(UserWarning, match="xshard.sync\\(\\) inside a compiled step does nothing"):
        loss = step(x, y)
    torch.testing.assert_close(loss.cpu(), model(x, y).cpu())


def test_fsdp_no_sync_gradients_refused():
    from xshard.fsdp import FSDP

    torch.manual_seed(0)
    model = FSDP(MLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = (t.to(DEV) for t in make_batches("mlp", 1)[0])
    with model.no_sync():
        model(x, y).backward()
    xshard.sync()

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with pytest.raises(StateError, match="partial sums .*FSDP.no_sync"):
        xshard.compile(step)(x, y)
    step(x, y)  # the lazy path reduces them
    xshard.sync()
    assert all(p.grad is None for p in model.parameters())


def test_constant_device_tensor_warns(trained):
    model, opt, x, y = trained
    # Not a buffer, not an argument, not in a dict or list the step names: a helper's attribute.
    holder = types.SimpleNamespace(offset=torch.ones(4, device=DEV))

    @xshard.compile
    def forward(x):
        return model.fc2(torch.tanh(model.fc1(x))) + holder.offset

    with pytest.warns(UserWarning, match=r"reads 1 device tensor\(s\) that are not arguments.*"
                                         r"shapes \[4\]"):
        forward(x)


@pytest.mark.parametrize("draw", ["randn", "randperm"])
def test_random_draws_on_the_cpu_are_refused(trained, draw):
    """CPU draws inside the step would be constants of the program (each replay returned the
    first call's numbers); refused, the CPU generator put back, and device draws work."""
    model, opt, x, y = trained

    def noisy(x):
        if draw == "randn":
            return model.fc1(x + torch.randn(x.shape).to(DEV))
        return model.fc1(x[torch.randperm(x.shape[0])])

    torch.manual_seed(3)
    with pytest.raises(StateError, match=r"draws random numbers on the CPU.*device=xshard"):
        xshard.compile(noisy)(x)
    after = torch.rand(2)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(2))  # the generator as before the call

    def device_noise(x):
        return x + torch.randn(x.shape, device=DEV)

    step = xshard.compile(device_noise)
    assert not torch.equal(step(x).cpu(), step(x).cpu())


class _LayerDrop(torch.nn.Module):
    """Drops its layer at random with a generator of its own (fairseq's LayerDrop idiom)."""

    def __init__(self, layer, rng):
        super().__init__()
        self.layer, self.rng = layer, rng

    def forward(self, x):
        return x if self.rng.random() < 0.5 else self.layer(x)


@pytest.mark.parametrize("source", ["random", "numpy", "numpy generator in a closure",
                                    "generator of a module", "torch generator argument"])
def test_python_numpy_and_torch_cpu_random_draws_are_refused(trained, source):
    """A choice drawn from Python's or NumPy's generators, or noise from a CPU torch.Generator
    (seeded augmentation), was built into the program: every replay took the first call's draws,
    where eager draws anew (a silent wrong answer). Refused, naming the generator, which is put
    back as it was."""
    model, opt, x, y = trained
    rng = np.random.default_rng(0)
    drop = _LayerDrop(model.fc1, random.Random(0))

    def step(x, gen=None):
        if source == "random":
            keep = random.random() < 0.5
        elif source == "numpy":
            keep = np.random.rand() < 0.5
        elif source == "numpy generator in a closure":
            keep = rng.random() < 0.5
        elif source == "torch generator argument":
            return model.fc1(x + torch.randn(x.shape, generator=gen).to(x.device))
        else:
            return drop(x)
        return model.fc1(x) if keep else x

    torch_gen = torch.Generator().manual_seed(0)
    generator = {"random": random.random.__self__, "numpy": np.random.rand.__self__,
                 "numpy generator in a closure": rng, "generator of a module": drop.rng,
                 "torch generator argument": torch_gen}[source]
    draw = (lambda g: torch.rand(1, generator=g).item()) if source.startswith("torch") else \
        (lambda g: g.random())
    before = copy.deepcopy(generator) if not source.startswith("torch") else \
        torch.Generator().set_state(torch_gen.get_state())
    named = {"random": "Python's random module", "numpy": "NumPy's global generator",
             "numpy generator in a closure": "the generator closure variable 'rng'",
             "generator of a module": "the generator _LayerDrop.rng",
             "torch generator argument": "the generator argument 1"}[source]
    with pytest.raises(StateError, match=rf"draws random numbers from {named}.*on the device"):
        xshard.compile(step)(x, torch_gen)
    assert draw(generator) == draw(before)  # put back as it was
    step(x, torch_gen)  # the lazy path still runs it


def test_number_used_as_a_number(trained):
    model, opt, x, y = trained

    def repeat(x, n):
        for _ in range(n):  # n is a 0-d tensor inside the step
            x = torch.tanh(x)
        return x

    with pytest.raises(CaptureError, match="make it static"):
        xshard.compile(repeat)(x, 2)
    out = xshard.compile(repeat, static_argnums=1)(x, 2)
    torch.testing.assert_close(out.cpu(), torch.tanh(torch.tanh(x)).cpu())

    def weigh(x, weights):  # a list of numbers made a tensor: it raised NotImplementedError
        return x[:, :2] * torch.as_tensor(weights, device=x.device)

    with pytest.raises(CaptureError, match=r"torch.as_tensor\(weights.*make it static"):
        xshard.compile(weigh)(x, [2.0, 3.0])


def test_argument_with_autograd_history_is_refused(trained):
    """A device copy of a CPU leaf that requires grad: backward inside the step would flow out of
    it (the recording aborted the interpreter inside the autograd engine)."""
    model, opt, x, y = trained
    x_cpu = make_batches("mlp", 1)[0][0].requires_grad_(True)

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        return loss

    with pytest.raises(StateError, match=r"argument 0 has autograd history .*ToCopyBackward0"
                                         r".*x\.detach\(\)"):
        xshard.compile(step)(x_cpu.to(DEV), y)
    step(x_cpu.to(DEV), y)  # the lazy path backpropagates into the CPU leaf, as eager does
    assert x_cpu.grad is not None and x_cpu.grad.abs().sum() > 0


def test_returned_gradient_of_an_argument():
    """The step returns ``x.grad`` of an argument that requires grad: each call returns the right
    gradient, which is the argument's ``.grad`` itself, as in eager (the second call's recording
    once failed: the first call's ``x.grad`` stayed pending on consumed arrays; later the first
    call's ``x.grad`` was not updated, and replays left ``x.grad`` None)."""
    def run(device, compiled):
        torch.manual_seed(0)
        model = MLP().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(x, y):
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss, x.grad

        fn = xshard.compile(step) if compiled else step
        out, args = [], []
        for x, y in make_batches("mlp", 4):
            x = x.to(device).requires_grad_(True)
            loss, grad = fn(x, y.to(device))
            assert grad is x.grad
            out.append((loss.item(), grad.cpu()))
            args.append(x)
        return out, [x.grad.cpu() for x in args]

    (cpu, cpu_grads), (dev, dev_grads) = run("cpu", False), run(DEV, True)
    for (a, ga), (b, gb) in zip(cpu, dev):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-6)
    for a, b in zip(cpu_grads, dev_grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
