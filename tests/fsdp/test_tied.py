"""A weight shared by two modules (tied embeddings) under FSDP, whichever units the policy makes
(#10 item 9): its gradient, and the optimizer state made from it, are laid out like the parameter,
and training equals eager.

The cases differ in who owns the weight: one unit holding both uses (transformer policy: the
root), its own unit read directly by a module outside it (size policy: the embedding is a unit,
the LM head is not), two units (the embedding's owns it, the head's gets none of its own), or the
head's unit owning it with the embedding outside.
"""

import functools
import gc

import pytest
import torch
import torch.nn as nn

import xshard
import xshard.spmd as xs
from xshard import memory
from xshard.fsdp import FSDP, size_based_auto_wrap_policy, transformer_auto_wrap_policy

DEV = xshard.device()
VOCAB, WIDTH, BATCH, SEQ = 64, 16, 8, 4


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class TiedLM(nn.Module):
    """Embedding (64 x 16 = 1024 parameters), two bodies (272 each), the head tied to it."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(Body(), Body())
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens, targets):
        logits = self.head(self.body(self.emb(tokens)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _is_embedding(module):
    return isinstance(module, nn.Embedding)


def _is_head(module):
    return isinstance(module, nn.Linear) and module.out_features == VOCAB


def _wrap(*predicates):
    def policy(module, recurse, nonwrapped_numel):
        return recurse or any(p(module) for p in predicates)
    return policy


POLICIES = {
    "transformer": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Body}),
    "size": functools.partial(size_based_auto_wrap_policy, min_num_params=1000),
    "embedding and head units": _wrap(_is_embedding, _is_head),
    "head unit": _wrap(_is_head),
}


def _model(policy):
    torch.manual_seed(0)
    eager = TiedLM()
    model = TiedLM()
    model.load_state_dict(eager.state_dict())
    return FSDP(model, auto_wrap_policy=POLICIES[policy]), eager


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(n)]


def test_the_policies_put_the_tied_weight_where_the_cases_say():
    model, _ = _model("size")
    assert model.emb in model.fsdp_units and model.head not in model.fsdp_units
    model, _ = _model("embedding and head units")
    assert model.emb in model.fsdp_units and model.head in model.fsdp_units
    model, _ = _model("head unit")
    assert model.emb not in model.fsdp_units and model.head in model.fsdp_units


@pytest.mark.parametrize("policy", POLICIES)
def test_tied_gradient_is_laid_out_like_its_parameter(policy):
    model, eager = _model(policy)
    weight = model.emb.weight
    assert weight is model.head.weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for tokens, targets in _batches(3):
        loss = model(tokens.to(DEV), targets.to(DEV))
        loss.backward()
        assert xs.get_sharding_spec(weight.grad) == xs.get_sharding_spec(weight)  # pending
        xshard.sync()
        assert xs.get_sharding_spec(weight.grad) == xs.get_sharding_spec(weight)  # computed
        eager_loss = eager(tokens, targets)
        eager_loss.backward()
        torch.testing.assert_close(loss.cpu(), eager_loss.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(weight.grad.cpu(), eager.emb.weight.grad, rtol=1e-4, atol=1e-6)
        opt.step()
        eager_opt.step()
        opt.zero_grad()
        eager_opt.zero_grad()
        xshard.sync()
    for value in opt.state[weight].values():
        if value.dim():
            assert xs.get_sharding_spec(value) == xs.get_sharding_spec(weight)
    torch.testing.assert_close(weight.cpu(), eager.emb.weight.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_step_holds_a_gradient_shard_per_device(policy):
    """What docs/memory-scaling.md measures: XLA's layout of the gradients in a compiled steady
    step (compile-only), per device, equals the parameters' (the tied one was once replicated)."""
    with xshard.compile_only():
        with torch.device("meta"):
            module = TiedLM()
        model = FSDP(module, auto_wrap_policy=POLICIES[policy])
        tokens = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta").to(DEV)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def step():
            opt.zero_grad(set_to_none=True)
            model(tokens, tokens).backward()
            opt.step()

        step()
        memory.abstract_sync()
        step()
        m = memory.analyze_step(model.parameters(), opt, [tokens])
        # Data-free tensors must not outlive the test: a later sync would read them. FSDP's hooks
        # make reference cycles, so collect.
        del model, module, opt, tokens, step
        gc.collect()
    assert m.gradient_bytes == m.parameter_bytes
