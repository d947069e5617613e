"""FSDP's gradient buckets (``reduce_scatter_bucket_size_mb``): a unit's gradients reduced to their
shards together, in one reduce-scatter per bucket, equal eager CPU PyTorch whatever the bucket."""

import copy
import functools
import re

import pytest
import torch
import torch.nn as nn

import xshard
import xshard.spmd as xs
from xshard.core import compiler, execute
from xshard.fsdp import FSDP, MixedPrecision, transformer_auto_wrap_policy

from tests.fsdp.fsdp_testing import mesh


class Block(nn.Module):
    """Parameters split on dimension 0 (``up``, ``down.bias``), on dimension 1 (``down.weight``,
    24 x 64: its largest dimension is 1) and unevenly (``out``: 13 rows, not a multiple of 8)."""

    def __init__(self, d=24):
        super().__init__()
        self.up = nn.Linear(d, 64)
        self.down = nn.Linear(64, d)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, 13)
        self.back = nn.Linear(13, d, bias=False)

    def forward(self, x):
        h = self.norm(x + self.down(torch.tanh(self.up(x))))
        return h + self.back(torch.sin(self.out(h)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(24, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


POLICY = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
# One Block holds 24*64 + 64 + 64*24 + 24 + 2*24 + 24*13 + 13 + 13*24 = 3845 float32 parameters.
BLOCK_BYTES = 4 * 3845


def net():
    torch.manual_seed(0)
    return Net()


def inputs(n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 24, generator=g) for _ in range(n)]


def reductions(model, x) -> list[str]:
    """Backward of ``model`` on ``x``: the result shapes of the reductions XLA compiled."""
    model(x.to(xshard.device())).backward()
    hlo = compiler.executable(execute.pending_step().graph).compiled.as_text()
    xshard.sync()
    return re.findall(r"= (\S+) (all-reduce|reduce-scatter)(?:-start)?\(", hlo)


@pytest.mark.parametrize("mb", [0, BLOCK_BYTES / 3 / 2 ** 20, 25])
def test_training_matches_eager_whatever_the_bucket(mb):
    reference = net()
    model = FSDP(copy.deepcopy(reference), auto_wrap_policy=POLICY,
                 reduce_scatter_bucket_size_mb=mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x in inputs():
        ref_loss = reference(x)
        ref_loss.backward()
        loss = model(x.to(xshard.device()))
        loss.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
            assert xs.get_sharding_spec(p.grad) == xs.get_sharding_spec(p), name
        torch.testing.assert_close(loss.item(), ref_loss.item(), rtol=1e-5, atol=0)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_one_reduce_scatter_per_bucket():
    x = inputs(1)[0]
    alone = reductions(FSDP(net(), auto_wrap_policy=POLICY, reduce_scatter_bucket_size_mb=0), x)
    whole = reductions(FSDP(net(), auto_wrap_policy=POLICY), x)
    # Per gradient: every parameter but the uneven ``out.bias`` (reduced where XLA computes it)
    # gets its own reduce-scatter.
    n_params = len(list(net().parameters()))
    assert sum(kind == "reduce-scatter" for _, kind in alone) == n_params - 3, alone
    # The default bucket (25 MB) holds a whole unit: one reduce-scatter per Block and one for the
    # root's head; the loss and the three uneven biases are all-reduces, as before.
    scattered = [shape for shape, kind in whole if kind == "reduce-scatter"]
    # Each device's shard of a Block's gradients but the uneven bias: (3845 - 13) / 8 values.
    assert sorted(s.split("{")[0] for s in scattered) == ["f32[1,25]"] + ["f32[1,479]"] * 3, whole
    assert len(whole) < len(alone) / 3, (whole, alone)


def test_buckets_split_a_unit_by_size():
    x = inputs(1)[0]
    # Room for about a third of a Block: its gradients go in several reduce-scatters.
    small = reductions(FSDP(net(), auto_wrap_policy=POLICY,
                            reduce_scatter_bucket_size_mb=BLOCK_BYTES / 3 / 2 ** 20), x)
    n = sum(kind == "reduce-scatter" for _, kind in small)
    assert 3 * 3 <= n <= 3 * 5 + 1, small


def test_mixed_precision_buckets_gradients_of_the_reduce_dtype():
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    x = inputs(1)[0]
    grads = []
    for mb in (0, 25):
        model = FSDP(net(), auto_wrap_policy=POLICY, mixed_precision=mp,
                     reduce_scatter_bucket_size_mb=mb)
        found = reductions(model, x)
        grads.append([p.grad.cpu() for p in model.parameters()])
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        # As in test_one_reduce_scatter_per_bucket.
        assert sum(kind == "reduce-scatter" for _, kind in found) == (26 if mb == 0 else 4)
    # The same bf16 gradients summed in another grouping: equal up to bf16 rounding.
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)


def test_hybrid_sharding_and_no_sync_match_eager():
    """Parameters split over ``fsdp`` only, gradients summed over ``data`` too: reduced per
    gradient, as before; and no_sync's accumulated rows join the bucket of the step leaving it."""
    reference = net()
    hybrid = FSDP(copy.deepcopy(reference), mesh=mesh(8, ("data", "fsdp"), (2, 4)),
                  extra_data_axis="data", auto_wrap_policy=POLICY)
    plain = FSDP(copy.deepcopy(reference), auto_wrap_policy=POLICY)
    xs_ = inputs(2)
    for x in xs_:
        reference(x).backward()
    dev = xshard.device()
    hybrid(xs_[0].to(dev)).backward()
    hybrid(xs_[1].to(dev)).backward()
    with plain.no_sync():
        plain(xs_[0].to(dev)).backward()
    # The step leaving no_sync reduces the accumulated rows with its own, in the same buckets.
    found = reductions(plain, xs_[1])
    assert sum(kind == "reduce-scatter" for _, kind in found) == 4, found
    for model in (hybrid, plain):
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
            assert xs.get_sharding_spec(p.grad) == xs.get_sharding_spec(p), name


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "25", None])
def test_bad_bucket_size(bad):
    with pytest.raises(ValueError, match="reduce_scatter_bucket_size_mb must be a finite number"):
        FSDP(net(), auto_wrap_policy=POLICY, reduce_scatter_bucket_size_mb=bad)
