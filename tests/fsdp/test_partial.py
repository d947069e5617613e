"""Per-device partial sums (xshard.fsdp.partial): rows equal eager CPU PyTorch on each batch block,
sum to the value, and need no reduction across devices; a partial sum survives syncs unreduced."""

import re

import pytest
import torch
import torch.nn.functional as F

import xshard
import xshard.spmd as xs
from xshard.core import compiler, ir
from xshard.core import tensor as xt
from xshard.core.graph import Graph
from xshard.fsdp import partial

N = 8
MESH = xs.Mesh(range(N), (N,), ("fsdp",))
ROWS = lambda ndim: xs.sharding.annotation(MESH, ("fsdp",) + (None,) * ndim, ndim + 1)  # noqa: E731


def batch_sharded(t: torch.Tensor) -> torch.Tensor:
    d = t.to(xshard.device())
    xs.mark_sharding(d, MESH, ("fsdp",) + (None,) * (t.dim() - 1))
    return d


def rows_of(value: torch.Tensor) -> torch.Tensor:
    node = partial.per_device_rows(value._value(), partial.BatchDims(("fsdp",), N),
                                   ROWS(value.dim()).jax_sharding)
    return xt.new_base(node)


def reductions(t: torch.Tensor) -> list:
    hlo = compiler.compile_graph(Graph([t._value()])).as_text()
    return re.findall(r"(?:all-reduce|reduce-scatter)(?:-start)?\(", hlo)


def weight_grad(x, dy):
    return x.reshape(-1, x.shape[-1]).t() @ dy.reshape(-1, dy.shape[-1])


def bias_grad(x, dy):
    return dy.sum((0, 1))


def token_embedding_grad(x, dy):
    return torch.ops.aten.embedding_dense_backward(dy, x[..., 0].long().abs() % 5, 5, -1, False)


def position_embedding_grad(x, dy):
    summed = dy.sum(0, keepdim=True).reshape(dy.shape[1:])
    return torch.ops.aten.embedding_dense_backward(summed, torch.arange(dy.shape[1]).to(dy.device),
                                                   dy.shape[1], -1, False)


def layer_norm_weight_grad(x, dy):
    w = torch.linspace(0.5, 1.5, x.shape[-1]).to(x.device).requires_grad_()
    out = F.layer_norm(x, x.shape[-1:], w)
    return torch.autograd.grad(out, w, dy[..., :4])[0]


def conv_weight_grad(x, dy):
    w = torch.linspace(-1, 1, 6 * 4 * 3).reshape(6, 4, 3).to(x.device).requires_grad_()
    out = F.conv1d(x.transpose(1, 2), w, padding=1)
    return torch.autograd.grad(out, w, dy.transpose(1, 2)[:, :6])[0]


@pytest.mark.parametrize("fn", [weight_grad, bias_grad, token_embedding_grad,
                                position_embedding_grad, layer_norm_weight_grad, conv_weight_grad])
def test_rows_are_the_blocks_contributions_without_reductions(fn):
    torch.manual_seed(0)
    x, dy = torch.randn(16, 5, 4), torch.randn(16, 5, 6)
    value = fn(batch_sharded(x), batch_sharded(dy))
    rows = rows_of(value)
    assert rows._value().inputs[0].op == ir.PER_DEVICE
    assert reductions(rows) == []
    expected = torch.stack([fn(a, b) for a, b in zip(x.chunk(N), dy.chunk(N))])
    torch.testing.assert_close(rows.cpu(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows.cpu().sum(0), fn(x, dy), rtol=1e-5, atol=1e-5)


def test_a_value_without_a_batch_sum_goes_whole_into_row_zero():
    w = torch.randn(3, 4)
    value = w.to(xshard.device()) * 2
    rows = rows_of(value)
    assert rows._value().inputs[0].op == ir.FIRST_ROW
    expected = torch.zeros(N, 3, 4)
    expected[0] = w * 2
    torch.testing.assert_close(rows.cpu(), expected)


def test_a_contraction_over_features_is_not_split():
    # dx = dy @ W: the batch stays a dimension of the result, nothing to split.
    dy, w = torch.randn(16, 6), torch.randn(6, 4)
    value = batch_sharded(dy) @ w.to(xshard.device())
    assert rows_of(value)._value().inputs[0].op == ir.FIRST_ROW


def test_batch_dims_follow_views_transposes_and_reductions():
    x = batch_sharded(torch.randn(16, 5, 4))
    batch = partial.BatchDims(("fsdp",), N)
    assert batch.dim(x._value()) == 0
    assert batch.dim(x.reshape(80, 4)._value()) == 0
    assert batch.dim(x.reshape(80, 4).t()._value()) == 1
    assert batch.dim(x.transpose(0, 2)._value()) == 2
    assert batch.dim(torch.tanh(x)._value()) == 0
    assert batch.dim(x.sum(1)._value()) == 0
    assert batch.dim(x.sum(0)._value()) is None
    assert batch.dim((x.reshape(80, 4) @ torch.randn(4, 3).to(x.device))._value()) == 0
    assert batch.dim(torch.randn(16, 5).to(x.device)._value()) is None  # replicated


def test_a_partial_sum_stays_unreduced_across_syncs_and_reads_as_the_sum():
    torch.manual_seed(0)
    x, dy = torch.randn(16, 5, 4), torch.randn(16, 5, 6)
    rows = rows_of(weight_grad(batch_sharded(x), batch_sharded(dy)))
    total = xt.new_base(ir.partial_sum(rows._value(), ROWS(2).jax_sharding))
    xshard.sync()
    value = total._cell.value
    assert value.op == ir.PARTIAL_SUM and value.inputs[0].is_data
    assert value.inputs[0].payload.shape == (N, 4, 6)  # each device keeps its row
    assert xs.get_sharding_spec(xt.new_base(value.inputs[0])).startswith("{devices=[8,1,1]")
    xshard.sync()
    assert total._cell.value is value  # nothing to compute
    torch.testing.assert_close(total.cpu(), weight_grad(x, dy), rtol=1e-5, atol=1e-5)
    doubled = total * 2
    assert reductions(doubled)  # the graph that reads it reduces
    torch.testing.assert_close(doubled.cpu(), 2 * weight_grad(x, dy), rtol=1e-5, atol=1e-5)
