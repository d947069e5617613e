"""Writes of a few elements into sharded tensors (``x[1] += 1``, writes through views, one-index
``index_put_`` / ``scatter_`` / ``index_add_``) against eager CPU PyTorch, on shapes that split
evenly and unevenly and on tensors resharded inside the same program: XLA's CPU scatter expansion
got these wrong (see [Note: scatters on the CPU backend] in xshard/core/compiler.py)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import xshard
import xshard.spmd as xs
from xshard.core import compiler, ir, runtime

DEV = xshard.device()


def mesh():
    return xs.Mesh(np.arange(8), (4, 2), ("data", "model"))


def _idx(t, *values):
    return torch.tensor(values, device=t.device)


WRITES = {
    "x[1] += 100": lambda t: t[1].add_(100),
    "x[1:][0] += 100": lambda t: t[1:][0].add_(100),
    "x[2:9][3] = 7": lambda t: t[2:9][3].fill_(7),
    "x[-1] = -5": lambda t: t[-1].fill_(-5),
    "x[1:5] = 0": lambda t: t[1:5].zero_(),
    "index_put_ one index": lambda t: t.index_put_((_idx(t, 1),), torch.tensor(7.).to(t.device)),
    "index_put_ accumulate": lambda t: t.index_put_((_idx(t, 6),), torch.tensor(3.).to(t.device),
                                                    accumulate=True),
    "scatter_ one index": lambda t: t.scatter_(0, _idx(t, 1), 9.),
    "index_add_ one index": lambda t: t.index_add_(0, _idx(t, 5), torch.ones(1).to(t.device)),
    "index_fill_": lambda t: t.index_fill_(0, _idx(t, 2), -1.),
}

# (shape, partition spec): even and uneven splits of dim 0, and of dim 0 over both axes.
LAYOUTS = [((16,), ("data",)), ((13,), ("data",)), ((13,), (("data", "model"),)),
           ((7,), ("data",))]


def _vector(shape):
    return torch.arange(float(np.prod(shape))).reshape(shape)


@pytest.mark.parametrize("name", list(WRITES))
@pytest.mark.parametrize("shape,spec", LAYOUTS, ids=lambda v: str(v))
def test_write_into_sharded_vector(name, shape, spec):
    write = WRITES[name]
    expected = _vector(shape)
    write(expected)
    d = _vector(shape).to(DEV)
    xs.mark_sharding(d, mesh(), spec)
    write(d)
    torch.testing.assert_close(d.cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["x[1] += 100", "x[1:][0] += 100", "index_put_ one index",
                                  "scatter_ one index"])
def test_write_after_sync(name):
    """The sharded data is the program's input (padded to 16 rows)."""
    write = WRITES[name]
    expected = _vector((13,))
    write(expected)
    d = _vector((13,)).to(DEV)
    xs.mark_sharding(d, mesh(), ("data",))
    xshard.sync(wait=True)
    write(d)
    torch.testing.assert_close(d.cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [13, 16])
def test_resharded_intermediate(rows):
    """A value computed replicated, resharded by an annotation inside the same program, then
    written into (rows of a matrix and a column through a transposed view)."""
    x = torch.arange(rows * 3.).reshape(rows, 3)
    expected = x * 2
    expected[2] += 1
    expected.t()[1][4:6] = -1
    y = x.to(DEV) * 2
    xs.mark_sharding(y, mesh(), ("data", None))
    y[2] += 1
    y.t()[1][4:6] = -1
    torch.testing.assert_close(y.cpu(), expected, rtol=0, atol=0)


def test_sharded_step_with_writes():
    """A training-like step: embedding rows updated through an index, on a sharded table."""
    weight = torch.randn(13, 4, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([3, 3, 12, 0])
    expected = weight.clone()
    expected.index_add_(0, ids, torch.ones(4, 4))
    expected[5] = 0
    w = weight.to(DEV)
    xs.mark_sharding(w, mesh(), ("data", None))
    w.index_add_(0, ids.to(DEV), torch.ones(4, 4).to(DEV))
    w[5] = 0
    torch.testing.assert_close(w.cpu(), expected)


def test_cpu_compiler_options():
    """Every CPU program compiles without the scatter expander (and, as on every backend, without
    excess precision); a barrier's options add theirs."""
    if runtime.platform() != "cpu":
        pytest.skip("the option is for XLA's CPU backend")
    plain = SimpleNamespace(order=[SimpleNamespace(op=ir.DATA)])
    assert compiler.compiler_options(plain) == {"xla_disable_hlo_passes": "scatter_expander",
                                                "xla_allow_excess_precision": False}
    fenced = SimpleNamespace(order=[SimpleNamespace(op=ir.DATA), SimpleNamespace(op=ir.BARRIER)])
    options = compiler.compiler_options(fenced)
    assert options["xla_disable_hlo_passes"] == "scatter_expander,cpu-all-reduce-combiner"
    assert options["xla_cpu_scheduler_type"] == "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"


# Combining scatters whose indices or updates are split unevenly over one axis of a 2-D mesh
# (replicated over the other): the partitioner's padding slots, index 0, took part (see
# [Note: combining scatters over uneven shardings] in xshard/core/lowering/table.py).
def _index_of(d):
    return torch.tensor([[1, 2], [3, 0], [5, 5], [1, 4], [2, 1]], device=d.device)


def _scatter_reduce(how, include_self=True):
    return lambda d: torch.zeros(6, 2, device=d.device).add(3.).scatter_reduce(
        0, _index_of(d), d, how, include_self=include_self)


COMBINING = {
    "scatter_reduce prod": _scatter_reduce("prod"),
    "scatter_reduce amin": _scatter_reduce("amin"),
    "scatter_reduce amax of negatives": lambda d: torch.full((6, 2), -50., device=d.device)
    .scatter_reduce(0, _index_of(d), -d - 1, "amax", include_self=False),
    "scatter_reduce mean": _scatter_reduce("mean", include_self=False),
    "scatter_add of exp": lambda d: torch.zeros(6, 2, device=d.device).scatter_add(
        0, _index_of(d), d.exp()),
    "scatter multiply": lambda d: torch.ones(6, 2, device=d.device).scatter(
        0, _index_of(d), d + 2, reduce="multiply"),
    "index_add": lambda d: torch.zeros(6, 2, device=d.device).index_add(
        0, _index_of(d)[:, 0], d.exp()),
    "index_put accumulate": lambda d: torch.zeros(6, 2, device=d.device).index_put(
        (_index_of(d)[:, 1],), d + 1, accumulate=True),
}


@pytest.mark.parametrize("name", list(COMBINING))
@pytest.mark.parametrize("axis", ["data", "model"])
def test_combining_scatter_of_updates_split_unevenly_over_one_axis(name, axis):
    fn = COMBINING[name]
    x = torch.arange(10.).reshape(5, 2) / 4
    d = x.to(DEV)
    xs.mark_sharding(d, mesh(), (axis, None))  # 5 rows over 4 or 2 devices, replicated over the rest
    torch.testing.assert_close(fn(d).cpu(), fn(x), rtol=1e-6, atol=1e-6)


BACKWARDS = {
    "embedding": lambda x, ids: torch.nn.functional.embedding(ids, x).exp().sum(),
    "gather": lambda x, ids: x.gather(0, ids[:, None].expand(5, 2)).exp().sum(),
    "indexing": lambda x, ids: x[ids].exp().sum(),
    "take_along_dim": lambda x, ids: torch.take_along_dim(x, ids[:, None], 0).exp().sum(),
}


@pytest.mark.parametrize("name", list(BACKWARDS))
@pytest.mark.parametrize("axis", ["data", "model"])
def test_backward_through_indices_split_unevenly_over_one_axis(name, axis):
    """Gradients are combining scatters of the incoming gradient at the indices."""
    loss = BACKWARDS[name]
    ids = torch.tensor([1, 2, 3, 4, 5])
    x = torch.zeros(6, 2, requires_grad=True)
    loss(x, ids).backward()
    d = torch.zeros(6, 2).to(DEV).requires_grad_()
    idd = ids.to(DEV)
    xs.mark_sharding(idd, mesh(), (axis,))
    loss(d, idd).backward()
    torch.testing.assert_close(d.grad.cpu(), x.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["max_pool1d", "cummax"])
def test_backward_of_max_positions_over_a_split_length(op):
    values = torch.tensor([[[0., 5, 1, 2, 9, 3, 4, 8]]])

    def loss(t):
        if op == "max_pool1d":
            return torch.nn.functional.max_pool1d(t, 3, 2).sum()
        return t[..., :5].cummax(-1).values.sum()

    x = values.clone().requires_grad_()
    loss(x).backward()
    d = values.to(DEV)
    xs.mark_sharding(d, mesh(), (None, None, "data"))
    d.requires_grad_()
    loss(d).backward()
    torch.testing.assert_close(d.grad.cpu(), x.grad, rtol=0, atol=0)
