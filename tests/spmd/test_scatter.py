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
    """Every CPU program compiles without the scatter expander; a barrier's options add theirs."""
    if runtime.platform() != "cpu":
        pytest.skip("the option is for XLA's CPU backend")
    plain = SimpleNamespace(order=[SimpleNamespace(op=ir.DATA)])
    assert compiler.compiler_options(plain) == {"xla_disable_hlo_passes": "scatter_expander"}
    fenced = SimpleNamespace(order=[SimpleNamespace(op=ir.DATA), SimpleNamespace(op=ir.BARRIER)])
    options = compiler.compiler_options(fenced)
    assert options["xla_disable_hlo_passes"] == "scatter_expander,cpu-all-reduce-combiner"
    assert options["xla_cpu_scheduler_type"] == "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
