"""Gradients a compiled step's ``backward()`` fills outside the model: an argument's ``.grad``, and
the ``.grad`` of leaf tensors the step reaches through its closure, its globals or a dict
(functional-style training). Eager CPU PyTorch is the oracle, call by call."""

import logging

import pytest
import torch

import xshard
from compile_testing import DEV
from xshard.step import StateError

CALLS = 4


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 3, generator=g)
    xs = [torch.randn(2, 4, generator=g) for _ in range(CALLS)]
    return w, xs


def _close(a, b):
    torch.testing.assert_close(b.detach().cpu(), a.detach().cpu(), rtol=1e-5, atol=1e-6)


def _argument_run(device, compiled, *, same=False, inside=False):
    w0, xs = _data()
    w = torch.nn.Parameter(w0.clone().to(device))
    opt = torch.optim.SGD([w], lr=0.1)

    def step(x):
        if inside:
            x.requires_grad_()
        loss = (x @ w).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    fn = xshard.compile(step) if compiled else step
    out, x = [], None
    for data in xs:
        if x is None or not same:
            x = data.to(device)
            if not inside:
                x.requires_grad_()
        loss = fn(x)
        out.append((loss.item(), x.requires_grad, x.grad.cpu().clone()))
    return out, fn


@pytest.mark.parametrize("case", ["fresh", "same", "inside"])
def test_argument_gradient(case, caplog):
    """``x.grad`` of an argument: a new argument each call, one argument passed on every call
    (its gradient accumulates over calls), and ``x.requires_grad_()`` inside the step (the flag
    is set on each call's argument too). Replays once left ``x.grad`` None."""
    kw = {"same": case == "same", "inside": case == "inside"}
    eager, _ = _argument_run("cpu", False, **kw)
    with caplog.at_level(logging.INFO, logger="xshard"):
        compiled, fn = _argument_run(DEV, True, **kw)
    for (la, fa, ga), (lb, fb, gb) in zip(eager, compiled):
        assert lb == pytest.approx(la, rel=1e-5)
        assert fb is fa
        _close(ga, gb)
    if case == "same":  # the second call reads the gradient the first left: recorded again
        assert fn.traces == 2
        assert "argument 0.grad: None -> tensor[2, 4]" in caplog.text
    else:
        assert fn.traces == 1


def _backward_step(w):
    """``xshard.compile`` of a step that backpropagates ``(x @ w).sum()``."""
    def step(x):
        loss = (x @ w).sum()
        loss.backward()
        return loss

    return xshard.compile(step)


def test_argument_with_autograd_history_at_a_replay():
    """An argument with autograd history is refused at a replay as at the recording (a replay
    would not backpropagate into the graph that made it: ``a.grad`` stayed None)."""
    fn = _backward_step(torch.nn.Parameter(torch.randn(4, 3).to(DEV)))
    for _ in range(2):
        fn(torch.randn(2, 4).to(DEV).requires_grad_())
    a = torch.randn(2, 4).to(DEV).requires_grad_()
    with pytest.raises(StateError, match=r"argument 0 has autograd history .*MulBackward0"):
        fn(a * 2)
    assert a.grad is None


def test_cpu_argument_requiring_grad_is_refused():
    """A CPU argument is passed as a device copy: its gradient would not reach it."""
    w = torch.nn.Parameter(torch.randn(4, 3).to(DEV))
    fn = _backward_step(w)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(StateError, match=r"argument 0 is a CPU tensor that requires grad.*"
                                         r"requires_grad_\(\)"):
        fn(x)
    assert x.grad is None and w.grad is None
    loss = fn(x.detach().to(DEV))  # the fix the message names
    assert loss.item() == pytest.approx((x.detach() @ w.detach().cpu()).sum().item(), rel=1e-5)


def _functional_run(device, compiled, pattern):
    w0, xs = _data(1)
    w = w0.clone().to(device).requires_grad_()
    params = {"w": w}

    def in_dict(x):  # manual SGD on a dict of tensors, gradients zeroed in place
        loss = (x @ params["w"]).square().sum()
        loss.backward()
        with torch.no_grad():
            params["w"] -= 0.01 * params["w"].grad
            params["w"].grad.zero_()
        return loss

    def accumulate(x):  # the closure's tensor: gradients accumulate over calls
        loss = (x @ w).square().sum()
        loss.backward()
        return loss

    fn = {"dict": in_dict, "accumulate": accumulate}[pattern]
    fn = xshard.compile(fn) if compiled else fn
    out = [fn(x.to(device)).item() for x in xs]
    return out, params["w"].detach().cpu(), params["w"].grad.cpu()


@pytest.mark.parametrize("pattern", ["dict", "accumulate"])
def test_loose_leaf_gradients(pattern):
    """A leaf tensor requiring grad that the step reaches (no module, no optimizer) gets its
    gradient as a parameter does; it was left out, and reading it raised."""
    (la, wa, ga), (lb, wb, gb) = _functional_run("cpu", False, pattern), \
        _functional_run(DEV, True, pattern)
    assert lb == pytest.approx(la, rel=1e-5)
    _close(wa, wb)
    _close(ga, gb)


def test_rebinding_a_loose_leaf_records_again(caplog):
    """``w`` rebound to another tensor between calls: its gradient goes to the new tensor."""
    w0, xs = _data(2)
    box = {}

    def run(device, compiled):
        box["w"] = w0.clone().to(device).requires_grad_()

        def step(x):
            loss = (x @ box["w"]).sum()
            loss.backward()
            return loss

        fn = xshard.compile(step) if compiled else step
        grads = []
        for k, x in enumerate(xs):
            if k == 2:
                box["w"] = (w0 * 2).to(device).requires_grad_()
            fn(x.to(device))
            grads.append(box["w"].grad.cpu().clone())
        return grads, fn

    eager, _ = run("cpu", False)
    with caplog.at_level(logging.INFO, logger="xshard"):
        compiled, fn = run(DEV, True)
    for a, b in zip(eager, compiled):
        _close(a, b)
    # Recordings: the first call, the second (reading the gradient the first left), the third
    # (another tensor), the fourth (reading its gradient).
    assert fn.traces == 4
    assert "box['w'] is another tensor object than the parameter it held" in caplog.text


def test_returned_tensor_kept_in_a_list():
    """A returned tensor that a list outside the state also keeps: reading the list's entry after
    a replay says to use the returned tensor (the step does not update it)."""
    w = torch.nn.Parameter(torch.randn(4, 3).to(DEV))
    opt = torch.optim.SGD([w], lr=0.1)
    history = []

    def step(x):
        loss = (x @ w).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append(loss)
        return loss

    fn = xshard.compile(step)
    losses = [fn(torch.randn(2, 4).to(DEV)) for _ in range(3)]
    assert all(torch.isfinite(loss.cpu()) for loss in losses)
    with pytest.raises(StateError, match="Use the tensor the call returned"):
        history[0].cpu()


def test_views_returned_under_inference_mode_are_normal_tensors():
    """A replay called under ``torch.inference_mode`` returns views of state (``buf[1:3]``) as
    eager does: views of a normal tensor are normal tensors, which may be written in place
    afterwards (they were inference tensors: "Inplace update to inference tensor")."""
    def run(device, compiled):
        torch.manual_seed(0)
        w = torch.randn(4, 3).to(device)
        buf = torch.zeros(4, 3).to(device)

        def step(x):
            buf.add_(x.sum() * w)
            return buf[1:3], buf.t()

        fn = xshard.compile(step, state=[buf]) if compiled else step
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            with torch.inference_mode():
                rows, t = fn(torch.randn(2, generator=g).to(device))
            assert not rows.is_inference() and not t.is_inference()
            rows.mul_(0.5)
        return buf.cpu()

    _close(run("cpu", False), run(DEV, True))
