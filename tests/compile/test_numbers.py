"""Python number arguments of a compiled step promote as the numbers they are, in their own
precision, as in eager (see [Note: numbers in a graph] in xshard/core/record.py): before, they
were 0-d tensors of the default dtype (int64 for ints), so ``bf16_0d * s`` gave float32, a float64
model multiplied by ``s`` rounded to float32, and ``1 - s`` was float32 arithmetic."""

from __future__ import annotations

import warnings

import pytest
import torch

import xshard
from compile_testing import DEV

bf16, f16, f64 = torch.bfloat16, torch.float16, torch.float64


def _inplace_mul(x, s):
    x = x.clone()
    x.mul_(s)
    return x


def _number_kept_in_place(x, s):
    s += 1  # a number op written into the number's tensor: still a number
    return x * s


# name -> (step, tensor arguments, the numbers of three calls)
CASES = {
    "bf16_0d * s": (lambda x, s: x * s, [torch.tensor(1.5, dtype=bf16)], [0.3, 0.7, 1.1]),
    "uint8_0d * n wraps": (lambda x, n: x * n, [torch.tensor(100, dtype=torch.uint8)], [3, 5, 7]),
    "int32_0d * n": (lambda x, n: x * n, [torch.tensor(7, dtype=torch.int32)], [2, 3, 2**33]),
    "float64 * s": (lambda x, s: x * s, [torch.tensor([1.0, 3.0], dtype=f64)], [0.1, 0.2, 0.3]),
    "1 - s in float64": (lambda x, s: x * (1 - s), [torch.tensor([1.0], dtype=f64)],
                         [0.9999, 0.99, 0.999999]),
    "s * s in float64": (lambda x, s: x * (s * s), [torch.tensor([1.0], dtype=f64)],
                         [0.1, 0.3, 0.7]),
    "n / 2 is a float": (lambda x, n: x * (n / 2), [torch.tensor([1.0], dtype=f64)], [7, 9, 1]),
    "n // 2 is an int": (lambda x, n: x * (n // 2), [torch.tensor([3], dtype=torch.int16)],
                         [7, 9, 1]),
    "s - f16_0d": (lambda x, s: s - x, [torch.tensor(1.5, dtype=f16)], [0.1, 0.2, 0.3]),
    "x ** s": (lambda x, s: x ** s, [torch.tensor(2.0, dtype=bf16)], [0.5, 1.5, 3.0]),
    "x > s": (lambda x, s: x > s, [torch.tensor([2.0, 3.0])], [2.5, 1.0, 4.0]),
    "clamp(max=s)": (lambda x, s: torch.clamp(x, max=s), [torch.tensor([2.0, 3.0], dtype=bf16)],
                     [2.5, 1.1, 9.0]),
    "where(c, bf16_0d, s)": (lambda c, x, s: torch.where(c, x, s),
                             [torch.tensor(False), torch.tensor(1.5, dtype=bf16)],
                             [0.3, 0.7, 1.1]),
    "lerp(bf16_0d, bf16_0d, s)": (lambda a, b, s: torch.lerp(a, b, s),
                                  [torch.tensor(1.0, dtype=bf16), torch.tensor(2.0, dtype=bf16)],
                                  [0.3, 0.7, 0.9]),
    "_foreach_div([bf16_0d], s)": (lambda x, s: torch._foreach_div([x], s)[0],
                                   [torch.tensor(1.0, dtype=bf16)], [3.0, 7.0, 0.1]),
    "int_tensor * s": (lambda x, s: x * s, [torch.tensor([1, 2], dtype=torch.int32)],
                       [1.5, 2.5, 0.25]),
    "bf16_0d.mul_(s)": (_inplace_mul, [torch.tensor(1.5, dtype=bf16)], [0.3, 0.7, 1.1]),
    "s += 1": (_number_kept_in_place, [torch.tensor([1.0], dtype=f64)], [0.1, 0.2, 0.3]),
}


@pytest.mark.parametrize("case", CASES)
def test_number_arguments_promote_as_in_eager(case):
    fn, tensors, numbers = CASES[case]
    step = xshard.compile(fn)
    before = xshard.metrics.snapshot()["compiles"]
    for number in numbers:
        expected = fn(*tensors, number)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the number's tensor is not kept state of the step
            got = step(*[t.to(DEV) for t in tensors], number).cpu()
        assert got.dtype == expected.dtype, (number, got.dtype, expected.dtype)
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=f"number {number!r}")
    # One program for all calls (two compiles: the recording and the replay executable).
    assert xshard.metrics.snapshot()["compiles"] - before <= 2


def test_float64_model_trains_with_the_exact_rate():
    """A float64 model stepped by hand with a learning rate passed as a number: every step equals
    eager's to the last bit (the rate rounded to float32 was 1.5e-9 off, relatively)."""
    torch.manual_seed(0)
    w0, x = torch.randn(4, 3, dtype=f64), torch.randn(8, 4, dtype=f64)

    def train(w, x, lr):
        loss = (x @ w).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            w -= lr * w.grad
            w.grad = None
        return loss.detach()

    w_eager = w0.clone().requires_grad_()
    w_dev = w0.to(DEV).requires_grad_()
    step, x_dev = xshard.compile(train), x.to(DEV)
    for lr in (0.1, 0.01, 0.3):
        expected = train(w_eager, x, lr)
        torch.testing.assert_close(step(w_dev, x_dev, lr).cpu(), expected, rtol=1e-15, atol=0)
        torch.testing.assert_close(w_dev.detach().cpu(), w_eager.detach(), rtol=1e-15, atol=0)


def test_op_without_a_number_overload_takes_a_default_dtype_tensor():
    """Eager refuses ``torch.maximum(x, 0.5)``; in a compiled step the number is a 0-d tensor
    there, of the default dtype (README, Known limits), with its value unrounded until the op."""
    x = torch.tensor([0.25, 0.75, 2.0], dtype=bf16)
    step = xshard.compile(lambda x, s: torch.maximum(x, s))
    for s in (0.5, 1.0):
        expected = torch.maximum(x, torch.tensor(s))
        got = step(x.to(DEV), s).cpu()
        assert got.dtype == expected.dtype == bf16
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("foreach", [False, True])
def test_float64_model_steps_by_the_learning_rate_itself(foreach):
    """The learning rate a compiled step reads from the optimizer is a number too: SGD on a
    float64 model matches eager to float64's precision (with the rate rounded to float32 it was
    1.2e-8 off, relatively, after 4 steps)."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 1)).double()
    on_device = copy.deepcopy(model).to(DEV)
    x, y = torch.randn(16, 4, dtype=f64), torch.randn(16, 1, dtype=f64)

    def make(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=foreach)

    def train(model, opt, x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    opt, opt_device = make(model.parameters()), make(on_device.parameters())
    step, x_dev, y_dev = xshard.compile(train), x.to(DEV), y.to(DEV)
    for _ in range(4):
        train(model, opt, x, y)
        step(on_device, opt_device, x_dev, y_dev)
    for expected, got in zip(model.parameters(), on_device.parameters()):
        torch.testing.assert_close(got.detach().cpu(), expected.detach(), rtol=1e-13, atol=1e-15)
