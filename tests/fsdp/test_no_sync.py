"""FSDP.no_sync(): gradient accumulation that reduces over devices once, not once per micro-step.

Values are compared with eager CPU PyTorch accumulating into .grad; collectives are read from the
HLO XLA compiled for each micro-step.
"""

import contextlib
import re

import pytest
import torch

import xshard
import xshard.spmd as xs
from xshard.core import compiler, execute
from xshard.fsdp import MixedPrecision

from tests.fsdp.fsdp_testing import CFG, POLICIES, SMALL, batches, fsdp_copy, gpt, mesh


def reductions(hlo: str) -> list[str]:
    """The result shapes of the all-reduces and reduce-scatters in compiled HLO."""
    return re.findall(r"= (\S+) (?:all-reduce|reduce-scatter)(?:-start)?\(", hlo)


def accumulate(model, micro, no_sync_steps):
    """Backward over ``micro``, the first ``no_sync_steps`` inside no_sync; a sync after each.
    Returns the reductions each micro-step compiled to."""
    dev = xshard.device()
    out = []
    for i, (x, y) in enumerate(micro):
        with model.no_sync() if i < no_sync_steps else contextlib.nullcontext():
            model(x.to(dev), y.to(dev)).backward()
        out.append(reductions(compiler.executable(execute.pending_step().graph).compiled.as_text()))
        xshard.sync()
    return out


def reference_grads(micro, cfg=SMALL):
    reference = gpt(0, cfg)
    for x, y in micro:
        reference(x, y).backward()
    return reference


def assert_grads_match(model, reference, rtol=1e-4, atol=1e-6):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("policy", ["transformer", "size"])
def test_micro_steps_under_no_sync_reduce_no_gradient(policy):
    micro = batches(3, distinct=3)
    # Gradients reduced one by one (no buckets), so that reductions count gradients.
    options = dict(auto_wrap_policy=POLICIES[policy], reduce_scatter_bucket_size_mb=0)
    model = fsdp_copy(gpt(0, CFG), **options)
    inside, _, last = accumulate(model, micro, no_sync_steps=2)
    # Only the loss (a scalar mean over the sharded batch) is reduced inside no_sync.
    assert inside == ["f32[]"], inside
    plain = fsdp_copy(gpt(0, CFG), **options)
    (normal,) = accumulate(plain, micro[:1], no_sync_steps=0)
    # Every parameter's gradient is reduced in a plain step (the tied embedding once per use) ...
    assert len(normal) >= len(list(plain.parameters())) + 1
    # ... and the step leaving no_sync reduces the accumulated sum with its own, in one go.
    assert len(last) <= len(normal), (last, normal)
    assert_grads_match(model, reference_grads(micro, CFG))
    for p in model.parameters():
        assert xs.get_sharding_spec(p.grad) == xs.get_sharding_spec(p)


def test_gradients_read_inside_no_sync_are_the_running_sum():
    micro = batches(2, distinct=2)
    model = fsdp_copy(gpt(0, SMALL), auto_wrap_policy=POLICIES["transformer"])
    accumulate(model, micro, no_sync_steps=2)
    # Nothing reduced yet; reading sums the per-device rows (as the optimizer would).
    assert_grads_match(model, reference_grads(micro))


def test_optimizer_step_right_after_no_sync_loses_nothing():
    micro = batches(4, distinct=4)
    model = fsdp_copy(gpt(0, SMALL), auto_wrap_policy=POLICIES["transformer"])
    reference = gpt(0, SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for start in (0, 2):  # two accumulation rounds, both entirely inside no_sync
        for x, y in micro[start:start + 2]:
            reference(x, y).backward()
        accumulate(model, micro[start:start + 2], no_sync_steps=2)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        xshard.sync()
    # Adam turns rounding noise in near-zero gradients into updates of ~1e-5 (as without no_sync).
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-4, atol=1e-4, msg=name)


def test_no_sync_after_a_reduced_backward_and_zeroed_gradients():
    micro = batches(3, distinct=3)
    model = fsdp_copy(gpt(0, SMALL), auto_wrap_policy=POLICIES["transformer"])
    accumulate(model, micro[:1], no_sync_steps=0)  # reduced gradients first
    accumulate(model, micro[1:], no_sync_steps=2)  # then rows added into them
    assert_grads_match(model, reference_grads(micro))
    model.zero_grad(set_to_none=False)
    accumulate(model, micro[:2], no_sync_steps=1)
    assert_grads_match(model, reference_grads(micro[:2]))


def test_hybrid_sharding_accumulates_without_reducing():
    micro = batches(3, distinct=3)
    hybrid = mesh(8, ("data", "fsdp"), (2, 4))
    model = fsdp_copy(gpt(0, SMALL), mesh=hybrid, extra_data_axis="data",
                      auto_wrap_policy=POLICIES["transformer"])
    inside, _, _ = accumulate(model, micro, no_sync_steps=2)
    assert inside == ["f32[]"], inside
    assert_grads_match(model, reference_grads(micro))


def test_mixed_precision_accumulates_in_the_parameter_dtype():
    micro = batches(3, distinct=3)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = fsdp_copy(gpt(0, SMALL), mixed_precision=mp, auto_wrap_policy=POLICIES["transformer"])
    accumulate(model, micro, no_sync_steps=2)
    for p in model.parameters():
        assert p.grad.dtype == torch.float32
    assert_grads_match(model, reference_grads(micro), rtol=5e-2, atol=5e-3)


def test_no_sync_restores_the_previous_mode_on_error():
    model = fsdp_copy(gpt(0, SMALL), auto_wrap_policy=POLICIES["transformer"])
    with pytest.raises(RuntimeError, match="boom"):
        with model.no_sync():
            raise RuntimeError("boom")
    assert model._fsdp_sync_grads


@pytest.mark.parametrize("policy", ["transformer", "size"])
def test_checkpointed_blocks_match_eager_and_accumulate_without_reducing(policy):
    from xshard.fsdp import FSDP, checkpoint_module

    micro = batches(3, distinct=3)
    model = gpt(0, SMALL)
    for block in model.blocks:
        checkpoint_module(block)
    model = FSDP(model, auto_wrap_policy=POLICIES[policy])
    inside, _, _ = accumulate(model, micro, no_sync_steps=2)
    if policy == "transformer":  # the unit is the checkpointed block: recomputed through it
        # Besides the loss, only one-element reads that order the gathers on CPU ([Note: FSDP
        # gathers ordered by data]): no gradient is reduced.
        assert "f32[]" in inside and all(re.fullmatch(r"\w+\[1?\](\{0\})?", r) for r in inside), \
            inside
    assert_grads_match(model, reference_grads(micro))
