"""FSDP training equals the unwrapped model on eager CPU; shardings of params, grads, optimizer state."""

import functools

import pytest
import torch

import xshard
import xshard.spmd as xs
from xshard.core import compiler, execute, ir
from xshard.core.graph import Graph
from xshard.fsdp import FSDP, MixedPrecision

from tests.fsdp.fsdp_testing import (POLICIES, SMALL, batches, fsdp_copy, gpt, mesh, train_cpu,
                                     train_device)

STEPS = 10
ALL8 = "{devices=[8,1]0,1,2,3,4,5,6,7}"


@pytest.fixture(scope="module", params=sorted(POLICIES))
def trained(request):
    """A GPT (4 blocks, tied embeddings) trained 10 AdamW steps on CPU and under FSDP on 8 devices."""
    reference = gpt()
    model = fsdp_copy(reference, auto_wrap_policy=POLICIES[request.param])
    data = batches(STEPS)
    cpu_losses = train_cpu(reference, data)
    losses, compiles, opt = train_device(model, data)
    return dict(policy=request.param, reference=reference, model=model, opt=opt, data=data,
                cpu_losses=cpu_losses, losses=losses, compiles=compiles)


def test_losses_and_parameters_match_cpu(trained):
    torch.testing.assert_close(torch.tensor(trained["losses"]),
                               torch.tensor(trained["cpu_losses"]), rtol=1e-4, atol=1e-5)
    assert trained["losses"][-1] < trained["losses"][0] - 0.3  # it trains
    # Parameters after 10 steps at lr=1e-2 (measured: at most 7e-5 apart; see ADAM_EPS for why
    # Adam's eps is raised).
    full = trained["model"].state_dict()
    for name, value in trained["reference"].state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-4, atol=2e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_steady_state_compiles_once(trained):
    compiles = trained["compiles"]
    assert compiles[1:] == [compiles[1]] * (STEPS - 1), compiles


def test_units_follow_the_policy(trained):
    model = trained["model"]
    names = {id(m): n for n, m in model.named_modules()}
    units = [names[id(u)] or "<root>" for u in model.fsdp_units]
    if trained["policy"] == "transformer":
        assert units == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "<root>"]
    else:  # attention (4096 params) and each MLP Linear (4096) reach 4000
        assert units[:3] == ["blocks.0.attn", "blocks.0.mlp.fc", "blocks.0.mlp.proj"]
        assert len(units) == 13 and units[-1] == "<root>"


def test_optimizer_state_sharded_like_parameters(trained):
    model, opt = trained["model"], trained["opt"]
    for name, p in model.named_parameters():
        state = opt.state[p]
        spec = xs.get_sharding_spec(p)
        assert spec, name
        assert xs.get_sharding_spec(state["exp_avg"]) == spec, name
        assert xs.get_sharding_spec(state["exp_avg_sq"]) == spec, name
    assert xs.get_sharding_spec(model.blocks[0].mlp.fc.weight) == ALL8  # (128, 32): dim 0


def test_gradients_sharded_like_parameters_and_reduce_scattered():
    # A fresh small model: one backward, then the gradient shardings and the collectives.
    model = fsdp_copy(gpt(cfg=SMALL), auto_wrap_policy=POLICIES["transformer"])
    x, y = batches(1)[0]
    dev = xshard.device()
    model(x.to(dev), y.to(dev)).backward()
    grads = [p.grad for p in model.parameters()]
    hlo = xshard.debug.compiled_hlo_text(grads)
    assert "all-gather" in hlo
    # CPU reduces a sharded gradient with all-reduce + slice; other backends use reduce-scatter.
    assert "reduce-scatter" in hlo or "all-reduce" in hlo
    xshard.sync()
    for name, p in model.named_parameters():
        assert xs.get_sharding_spec(p.grad) == xs.get_sharding_spec(p), name


def test_mixed_precision_bf16_compute_fp32_master_weights():
    reference = gpt(cfg=SMALL)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = fsdp_copy(reference, auto_wrap_policy=POLICIES["transformer"], mixed_precision=mp)
    data = batches(3)
    cpu_losses = train_cpu(reference, data)
    losses, _, opt = train_device(model, data)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=2e-2,
                               atol=2e-2)
    assert losses != cpu_losses  # it did compute in bf16
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        assert opt.state[p]["exp_avg"].dtype == torch.float32, name
    assert model.lm_head.weight is model.wte.weight


def test_hybrid_extra_data_axis_matches_cpu():
    reference = gpt(cfg=SMALL)
    model = fsdp_copy(reference, mesh=mesh(8, ("data", "fsdp"), (2, 4)), extra_data_axis="data",
                      auto_wrap_policy=POLICIES["transformer"])
    # Parameters are split 4 ways over fsdp and replicated over the 2 data groups.
    assert xs.get_sharding_spec(model.blocks[0].mlp.fc.weight) == \
        "{devices=[4,1,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}"
    _assert_trains_as_on_cpu(model, reference, batches(2, seed=5))


def _assert_trains_as_on_cpu(model, reference, data):
    """AdamW steps of ``model`` on the device and of ``reference`` on CPU: the same losses and
    parameters."""
    cpu_losses = train_cpu(reference, data)
    losses, _, _ = train_device(model, data)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-4,
                               atol=1e-5)
    full = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_without_optimization_barriers_matches_cpu_and_has_no_barrier():
    # [Note: FSDP without barriers]: XLA schedules the gathers freely; the numbers are the same.
    reference = gpt(cfg=SMALL)
    model = fsdp_copy(reference, auto_wrap_policy=POLICIES["transformer"],
                      optimization_barrier_in_forward=False,
                      optimization_barrier_in_backward=False)
    data = batches(3, seed=7)
    dev = xshard.device()
    x, y = data[0]
    model(x.to(dev), y.to(dev)).backward()
    graph = execute.pending_step().graph
    assert not [n for n in graph.order if n.op in ir.BARRIERS]
    assert compiler.compiler_options(graph) == compiler.compiler_options(Graph([]))  # no barrier's
    model.zero_grad(set_to_none=True)
    xshard.sync()
    _assert_trains_as_on_cpu(model, reference, data)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_each_barrier_option_alone(phase):
    reference = gpt(cfg=SMALL)
    model = fsdp_copy(reference, auto_wrap_policy=POLICIES["transformer"],
                      **{f"optimization_barrier_in_{phase}": False})
    dev = xshard.device()
    x, y = batches(1, seed=7)[0]
    loss = model(x.to(dev), y.to(dev))
    forward_barriers = [n for n in execute.pending_step().graph.order if n.op in ir.BARRIERS]
    loss.backward()
    all_barriers = [n for n in execute.pending_step().graph.order if n.op in ir.BARRIERS]
    # Forward barriers fence each unit's gathers in forward, backward ones in backward.
    if phase == "forward":
        assert not forward_barriers and all_barriers
    else:
        assert forward_barriers and len(all_barriers) == len(forward_barriers)
    torch.testing.assert_close(loss.item(), reference(x, y).item(), rtol=1e-5, atol=1e-6)
    xshard.sync()


def test_optimization_barrier_option_must_be_a_bool():
    with pytest.raises(TypeError, match=r"optimization_barrier_in_backward must be True or False, "
                                        r"got 'no'"):
        FSDP(gpt(cfg=SMALL), optimization_barrier_in_backward="no")


def test_parameter_data_replaced_after_wrapping_is_sharded_again():
    """``p.data = t`` on a wrapped parameter (a Hugging Face-style weight replacement) gives it
    an unsharded storage: the next forward shards it as FSDP had (backward raised an
    AttributeError)."""
    reference = gpt(cfg=SMALL)
    model = fsdp_copy(reference, auto_wrap_policy=POLICIES["transformer"])
    spec = xs.get_sharding_spec(model.blocks[0].mlp.fc.weight)
    new = torch.randn(reference.blocks[0].mlp.fc.weight.shape, generator=torch.Generator()
                      .manual_seed(3))
    reference.blocks[0].mlp.fc.weight.data = new.clone()
    model.blocks[0].mlp.fc.weight.data = new.to(xshard.device())
    _assert_trains_as_on_cpu(model, reference, batches(2, seed=5))
    assert xs.get_sharding_spec(model.blocks[0].mlp.fc.weight) == spec


class _CacheBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, h, cache, pos: int):
        cache[:, pos] = h.mean(-1)  # fills its slot of a buffer the caller owns
        return h + self.fc(h)


class _CacheNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_CacheBlock() for _ in range(2))

    def forward(self, x, cache, seen):
        seen.add_(1)  # the root's own forward writes an input too
        for i, b in enumerate(self.blocks):
            x = b(x, cache, i)
        return x


@pytest.mark.parametrize("barriers", [True, False])
def test_inputs_written_in_place_reach_the_caller(barriers):
    """A unit writing into a tensor its caller passed (a KV-cache slot) wrote into FSDP's fenced
    copy, and the root's sharded copy of its inputs took the root's writes: under no_grad the
    caller's tensors kept their old values, silently. They now get the writes, as in eager."""
    import copy
    import functools

    from xshard.fsdp import transformer_auto_wrap_policy

    torch.manual_seed(0)
    ref = _CacheNet()
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={_CacheBlock}),
        optimization_barrier_in_forward=barriers, optimization_barrier_in_backward=barriers)
    x = torch.randn(8, 16)
    cache, seen = torch.zeros(8, 2), torch.zeros(8, 3)
    with torch.no_grad():
        out = ref(x, cache, seen)
    dev = xshard.device()
    dcache, dseen = torch.zeros(8, 2, device=dev), torch.zeros(8, 3, device=dev)
    with torch.no_grad():
        dout = model(x.to(dev), dcache, dseen)
    torch.testing.assert_close(dout.cpu(), out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dcache.cpu(), cache, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dseen.cpu(), seen)


class _RopeBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def _forward(self, h, rope):
        return h + torch.tanh(self.fc(h) * rope)

    def forward(self, h, rope=None):
        from torch.utils.checkpoint import checkpoint
        if rope is None:
            return checkpoint(lambda h: h + torch.tanh(self.fc(h)), h, use_reentrant=True)
        return checkpoint(functools.partial(self._forward, rope=rope), h, use_reentrant=True)


class _RopeNet(torch.nn.Module):
    def __init__(self, rope: bool):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 16)
        self.blocks = torch.nn.ModuleList(_RopeBlock() for _ in range(2))
        self.head = torch.nn.Linear(16, 1)
        self.register_buffer("freq", torch.linspace(0.5, 1.5, 16))
        self.rope = rope

    def forward(self, ids):
        rope = torch.cos(self.freq * ids.shape[0]) if self.rope else None  # requires no grad
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h, rope=rope)  # a keyword argument, as Hugging Face passes cos/sin
        return self.head(h).pow(2).mean()


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("frozen_embedding", [False, True])
def test_unit_inputs_keep_their_requires_grad(frozen_embedding):
    """FSDP handed each unit fenced copies of its inputs that all required grad: reentrant
    checkpointing of a block taking a keyword tensor that requires no grad (Llama's rotary
    cos/sin) raised "Trying to backward through the graph a second time", and with a frozen
    embedding (nothing entering the blocks requires grad) the blocks got gradients eager does
    not compute, and an optimizer moved them, silently."""
    import copy

    from xshard.fsdp import transformer_auto_wrap_policy

    torch.manual_seed(0)
    ref = _RopeNet(rope=not frozen_embedding)
    ref.emb.weight.requires_grad_(not frozen_embedding)
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={_RopeBlock}))
    ids = torch.randint(0, 10, (8, 5))
    ref(ids).backward()
    model(ids.to(xshard.device())).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6)
