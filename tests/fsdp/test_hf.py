"""A Hugging Face GPT2LMHeadModel (random weights, no download) under FSDP matches eager CPU."""

import copy
import functools

import pytest
import torch

import xshard
import xshard.spmd as xs
from xshard.fsdp import FSDP, transformer_auto_wrap_policy

transformers = pytest.importorskip("transformers")


def test_gpt2_lm_head_model_trains_like_cpu():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, use_cache=False)
    reference = transformers.GPT2LMHeadModel(cfg)
    model = FSDP(copy.deepcopy(reference), auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block}))
    assert len(model.fsdp_units) == 3
    assert model.lm_head.weight is model.transformer.wte.weight
    assert list(model.state_dict()) == list(reference.state_dict())
    assert xs.get_sharding_spec(model.transformer.h[0].mlp.c_fc.weight)  # sharded

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    dev = xshard.device()
    for _ in range(3):
        ids = torch.randint(0, 128, (8, 16), generator=g)
        loss = model(input_ids=ids.to(dev), labels=ids.to(dev)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        xshard.sync()
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=1e-4, atol=1e-5)
