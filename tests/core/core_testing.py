"""Helpers shared by the core tests: eager CPU PyTorch is the oracle for every value."""

from __future__ import annotations

import contextlib

import torch

import xshard
from xshard import metrics

DEV = xshard.device()


def to_dev(tree):
    """``tree`` (tensors, lists, tuples, dicts) with every CPU tensor moved to the xshard device."""
    return _map(tree, lambda t: t.to(DEV))


def to_cpu(tree):
    return _map(tree, lambda t: t.cpu() if t.device.type != "cpu" else t)


def _map(tree, fn):
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(v, fn) for v in tree)
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    return tree


def assert_same(actual, expected, *, rtol=None, atol=None, exact_dtype=True):
    """Compares a (tree of) xshard result(s) with the eager CPU result(s): value, shape and dtype."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"expected a tensor, got {type(actual)}"
        assert actual.device.type == "xshard", f"result is on {actual.device}, not on xshard"
        got = actual.cpu()
        assert got.dtype == expected.dtype or not exact_dtype, (got.dtype, expected.dtype)
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True,
                                   check_dtype=exact_dtype)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e, rtol=rtol, atol=atol, exact_dtype=exact_dtype)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for k in expected:
            assert_same(actual[k], expected[k], rtol=rtol, atol=atol, exact_dtype=exact_dtype)
    else:
        assert actual == expected, (actual, expected)


def check(fn, *inputs, rtol=None, atol=None):
    """Runs ``fn`` on clones of the CPU ``inputs`` and on device copies; compares the results and
    the inputs afterwards (so mutations of the inputs are checked too)."""
    cpu_in = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    dev_in = to_dev(list(inputs))
    expected = fn(*cpu_in)
    actual = fn(*dev_in)
    assert_same(actual, expected, rtol=rtol, atol=atol)
    assert_same(dev_in, cpu_in, rtol=rtol, atol=atol)


@contextlib.contextmanager
def counting():
    """Yields a dict that, on exit, holds the change of each integer metric over the block."""
    before = metrics.snapshot()
    delta: dict = {}
    yield delta
    after = metrics.snapshot()
    for k, v in after.items():
        if isinstance(v, int):
            delta[k] = v - before[k]
    delta["cpu_fallbacks"] = {k: n - before["cpu_fallbacks"].get(k, 0)
                              for k, n in after["cpu_fallbacks"].items()
                              if n != before["cpu_fallbacks"].get(k, 0)}


def delta_since(before: dict) -> dict:
    after = metrics.snapshot()
    out = {k: v - before[k] for k, v in after.items() if isinstance(v, int)}
    out["cpu_fallbacks"] = {k: n - before["cpu_fallbacks"].get(k, 0)
                            for k, n in after["cpu_fallbacks"].items()
                            if n != before["cpu_fallbacks"].get(k, 0)}
    return out
