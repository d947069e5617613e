"""Executions in flight are bounded (see [Note: a bounded dispatch queue] in xshard.core.compiler):
a loop that never reads a value neither runs ahead of the devices without bound nor stops donating.
"""

import functools
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import xshard
from compile_testing import DEV, GPT_TINY, compiled_step, squared_output_step
from xshard.core import compiler
from xshard.step import packing
from xshard.step import program as program_module
from xshard.fsdp import FSDP, transformer_auto_wrap_policy
from xshard.models import GPT
from xshard.models.gpt import Block


def _fsdp_gpt():
    torch.manual_seed(0)
    model = FSDP(GPT(GPT_TINY), auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block}))
    # capturable: the step counts are device scalars, state each call donates to the next
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    return model, opt


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (8, 16), generator=g).to(DEV),
             torch.randint(0, 64, (8, 16), generator=g).to(DEV)) for _ in range(n)]


def test_lazy_and_compiled_loops_keep_at_most_max_in_flight():
    model, opt = _fsdp_gpt()
    data = _batches(3 * compiler.MAX_IN_FLIGHT)
    step = compiled_step(model, opt)
    lazy = step.fn  # the same function, run lazily
    losses = []
    for x, y in data:
        losses.append(lazy(x, y))
        xshard.sync()
        assert len(compiler._in_flight) <= compiler.MAX_IN_FLIGHT
    for x, y in data:
        losses.append(step(x, y))
        assert len(compiler._in_flight) <= compiler.MAX_IN_FLIGHT
    # The handles are the losses (scalars), never state a later call donates.
    held = {id(a) for arrays in compiler._in_flight for a in arrays}
    assert held and not any(a.is_deleted() for arrays in compiler._in_flight for a in arrays)
    xshard.wait()
    assert not compiler._in_flight
    assert all(torch.isfinite(loss.cpu()) for loss in losses)


def test_compiled_loop_still_donates_its_state(monkeypatch):
    model, opt = _fsdp_gpt()
    step = compiled_step(model, opt)
    data = _batches(compiler.MAX_IN_FLIGHT + 4)
    for x, y in data[:3]:
        step(x, y)
    copies = []
    real_copy = program_module._copy
    monkeypatch.setattr(program_module, "_copy", lambda a: copies.append(a) or real_copy(a))
    for x, y in data[3:]:
        step(x, y)
    assert step._last.donated and not copies  # no input copied because the queue holds it


def test_an_evaluation_step_keeps_no_copy_of_the_model(monkeypatch):
    """A second compiled step on the same model (evaluation, every other call) held the data it
    last read, so a copy of every parameter stayed alive between its calls and the training step
    copied them instead of consuming them (see [Note: donation of replayed state])."""
    import gc

    import jax

    gc.collect()
    before = sum(a.nbytes for a in jax.live_arrays())  # what earlier tests left
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @torch.no_grad()
    def evaluate(x):
        return model(x).pow(2).mean()

    train_step = xshard.compile(squared_output_step(model, opt))
    eval_step = xshard.compile(evaluate)
    x = torch.randn(4, 256).to(DEV)
    train_step(x), train_step(x), eval_step(x)
    copies = []
    real_copy = program_module._copy
    monkeypatch.setattr(program_module, "_copy", lambda a: copies.append(a) or real_copy(a))
    params = sum(p.numel() * 4 for p in model.parameters())
    for i in range(4):
        train_step(x)
        xshard.wait()
        gc.collect()
        live = sum(a.nbytes for a in jax.live_arrays()) - before
        assert live < 1.5 * params, (i, live, params)
        if i % 2:
            eval_step(x)
    assert not copies
    assert train_step.traces == eval_step.traces == 1


def _aliases(compiled) -> list[tuple[int, int]]:
    """(output, input) of each buffer the executable reuses, from its HLO module header."""
    header = compiled.as_text().split("\n", 1)[0]
    return [(int(o), int(i)) for o, i in re.findall(r"\{(\d+)\}: \((\d+), \{\}", header)]


@pytest.mark.parametrize("packed", [False, True])
def test_each_update_reuses_the_buffer_of_the_state_it_replaces(monkeypatch, packed):
    # XLA pairs donated buffers with outputs by size; a parameter's update given another
    # parameter's buffer makes it copy both (see [Note: inputs in the order of the outputs that
    # replace them] in xshard.core.graph). FSDP shards of equal size make such pairs likely.
    # Packed (see [Note: packed state] in xshard/step/packing.py): each pack reuses its own.
    if not packed:
        monkeypatch.setattr(packing, "MIN_PACKED", 10 ** 9)
    model, opt = _fsdp_gpt()
    step = compiled_step(model, opt)
    for x, y in _batches(3):
        step(x, y)
    program = step._last
    slot_of_input = dict(program.donated)  # the consumed inputs not packed
    slots_of_output = {}  # AdamW's step counts: one output stored into every count
    for w in program.writes:
        slots_of_output.setdefault(w.position, set()).add(w.slot)
    aliases = _aliases(program.compiled)
    n = len(program.packed.layouts) if packed else 0
    assert bool(program.packed) is packed
    if packed:  # input k of the packed executable: pack k, then the plain inputs it passes on
        assert sum(len(layout.members) for layout in program.packed.layouts) > 40
        assert sorted(a for a in aliases if a[0] < n) == [(g, g) for g in range(n)]
        aliases = [(program.packed.outputs[o - n], program.packed.inputs[i - n])
                   for o, i in aliases if o >= n]
    else:
        assert len(program.donated) > 40
    assert len(aliases) == len(program.donated)
    crossed = [(o, i) for o, i in aliases
               if slot_of_input.get(i) not in slots_of_output.get(o, ())]
    assert not crossed


SCRIPT = textwrap.dedent("""
    import functools, torch, xshard
    from xshard.fsdp import FSDP, transformer_auto_wrap_policy
    from xshard.models.gpt import GPT, Block, GPTConfig
    cfg = GPTConfig(vocab_size=1024, block_size=64, n_layer=2, n_head=4, n_embd=128)
    torch.manual_seed(0)
    model = FSDP(GPT(cfg), auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dev = xshard.device()
    x = torch.randint(0, 1024, (16, 64)).to(dev)
    y = torch.randint(0, 1024, (16, 64)).to(dev)

    @xshard.compile
    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range({n}):  # no value read: before the bound, XLA:CPU aborted at ~100 in flight
        loss = step(x, y)
    print("loss", float(loss.item()))
""")


def test_a_long_loop_without_reads_finishes():
    env = dict(os.environ, XSHARD_CPU_DEVICES="8", PJRT_DEVICE="CPU")
    run = subprocess.run([sys.executable, "-c", SCRIPT.replace("{n}", "400")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "loss" in run.stdout
