"""Packed state (see [Note: packed state] in xshard/step/packing.py): a replayed step passes the
small state arrays it updates in place as a few packed arrays. Every test compares with the lazy
path or with the same step unpacked, and checks that the packs were made (so the comparison is not
between two unpacked runs)."""

import copy
import functools
import gc
import sys
import weakref

import pytest
import torch
import torch.nn as nn

import xshard
import xshard.checkpoint as xcp
import xshard.spmd as xs
from compile_testing import (DEV, assert_models_close, assert_state_close,
                             compiled_step, make_batches, make_model, train_compiled, train_lazy)
from xshard.core import api, ir
from xshard.fsdp import FSDP, transformer_auto_wrap_policy
from xshard.mesh import Mesh
from xshard.models.gpt import Block
from xshard.step import packing


# The Adam family's bias corrections differ from the lazy path's by a few ulps per step (see
# ADAM_TOL in test_equivalence.py).
ADAM_TOL = dict(rtol=1e-4, atol=1e-5)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1)


def _fsdp(model):
    return FSDP(model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                          transformer_layer_cls={Block}))


def _two_d(model):
    mesh = Mesh(range(8), (4, 2), ("data", "model"))
    model = model.to(DEV)
    for block in model.blocks:
        xs.mark_sharding(block.attn.qkv.weight, mesh, ("model", None))
        xs.mark_sharding(block.attn.proj.weight, mesh, (None, "model"))  # split dim 1
    return model


def _node(t):
    return api.storage_value(api.storage(t))


def _layouts(step) -> list:
    packed = step._last.packed
    return packed.layouts if packed else []


def _twins(wrap, kind="gpt"):
    base = make_model(kind)
    models = [wrap(copy.deepcopy(base)) for _ in range(2)]
    return [(m, _adamw(m)) for m in models]


@pytest.mark.parametrize("wrap, blocks", [
    (lambda m: m.to(DEV), {1}),  # replicated
    (_fsdp, {8}),  # every parameter split over 8 devices
    (_two_d, {1, 2}),  # replicated, and split over "model" along dim 0 or dim 1
], ids=["one-layout", "fsdp", "2d"])
def test_packed_step_equals_lazy_path(monkeypatch, wrap, blocks):
    packed_anew = []
    real_pack = packing.Layout.pack
    monkeypatch.setattr(packing.Layout, "pack",
                        lambda self, arrays: packed_anew.append(self) or real_pack(self, arrays))
    (m1, o1), (m2, o2) = _twins(wrap)
    data = make_batches("gpt", 6)
    lazy = train_lazy(m1, o1, data)
    step = compiled_step(m2, o2)
    compiled = train_compiled(step, data)
    layouts = _layouts(step)
    # Packed from the members once, at the first replay; each later call passes the pack the
    # previous one returned.
    assert packed_anew == layouts
    assert {layout.blocks for layout in layouts} == blocks
    assert sum(len(layout.members) for layout in layouts) >= packing.MIN_PACKED
    torch.testing.assert_close(compiled, lazy, **ADAM_TOL)
    assert_models_close(m1, m2, **ADAM_TOL)
    assert_state_close(o1, o2, **ADAM_TOL)
    # The members' nodes know their layout without being cut out; it is the lazy path's.
    for p, q in zip(m1.parameters(), m2.parameters()):
        node = _node(q)
        if type(node) is ir.PackedData:
            assert node.sharding.is_equivalent_to(_node(p).sharding, p.dim())
    assert step.traces == 2  # the first call creates the optimizer state


def test_packed_step_equals_unpacked_step(monkeypatch):
    (m1, o1), (m2, o2) = _twins(_fsdp)
    data = [tuple(t.to(DEV) for t in b) for b in make_batches("gpt", 5)]
    packed = compiled_step(m2, o2)
    losses = [packed(*b).item() for b in data]
    monkeypatch.setattr(packing, "MIN_PACKED", 10 ** 9)
    plain = compiled_step(m1, o1)
    expected = [plain(*b).item() for b in data]
    assert _layouts(packed) and not _layouts(plain)
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)
    assert_models_close(m1, m2, rtol=1e-6, atol=1e-7)


def test_reading_state_between_calls_cuts_the_pack_and_the_next_call_packs_again():
    (m1, o1), (m2, o2) = _twins(_fsdp)
    data = make_batches("gpt", 6)
    step = compiled_step(m2, o2)
    lazy, compiled = [], []
    for i, (x, y) in enumerate(data):
        lazy += train_lazy(m1, o1, [(x, y)])
        compiled += train_compiled(step, [(x, y)])
        if i >= 2:  # packed since the first replay
            p = m2.blocks[0].ln_1.weight
            node = _node(p)
            assert type(node) is ir.PackedData and node.pack.array is not None
            torch.testing.assert_close(p.cpu(), m1.blocks[0].ln_1.weight.cpu())
            # One read cut every member out; the packed array is let go.
            assert node.pack.array is None
            assert type(_node(m2.blocks[1].ln_2.weight)) is ir.PackedData
    torch.testing.assert_close(compiled, lazy, **ADAM_TOL)
    assert_models_close(m1, m2, **ADAM_TOL)
    assert step.traces == 2


def test_a_call_passed_its_pack_whole_moves_the_members_nodes_to_the_next_pack():
    (m1, o1), (m2, o2) = _twins(_fsdp)
    data = make_batches("gpt", 6)
    step = compiled_step(m2, o2)
    lazy = train_lazy(m1, o1, data[:3])
    compiled = train_compiled(step, data[:3])  # the third call packs the members anew
    members = [p for p in m2.parameters() if type(_node(p)) is ir.PackedData]
    assert len(members) >= 4
    view = members[0][:2]  # not read yet: holds no node
    nodes = [weakref.ref(_node(p)) for p in members]  # (a strong one would keep a node apart)
    versions = [api.storage_version(api.storage(p)) for p in members]
    old = {n().pack for n in nodes}
    for k in range(1, 3):
        lazy += train_lazy(m1, o1, data[2 + k:3 + k])
        compiled += train_compiled(step, data[2 + k:3 + k])
        # The same nodes, now in the pack the call returned; a write counted in each storage;
        # the consumed pack let go.
        assert all(_node(p) is n() for p, n in zip(members, nodes))
        assert {id(n().pack) for n in nodes} == {id(p) for p in step._last.packs}
        assert all(n().pack.array is not None for n in nodes)
        assert [api.storage_version(api.storage(p)) for p in members] == [v + k for v in versions]
        assert all(sys.getrefcount(p) == 3 and not p.nodes for p in old)  # (old, p, the call)
        old = {n().pack for n in nodes}
    name = next(n for n, p in m2.named_parameters() if p is members[0])
    torch.testing.assert_close(view.cpu(), dict(m1.named_parameters())[name][:2].detach().cpu(),
                               **ADAM_TOL)
    lazy += train_lazy(m1, o1, data[5:])
    compiled += train_compiled(step, data[5:])  # the read cut the pack: packed anew
    assert all(_node(p) is not n() for p, n in zip(members, nodes))
    torch.testing.assert_close(compiled, lazy, **ADAM_TOL)
    assert_models_close(m1, m2, **ADAM_TOL)
    assert_state_close(o1, o2, **ADAM_TOL)
    assert step.traces == 2


@pytest.mark.parametrize("hold", ["shared", "pending"])
def test_tensors_holding_packed_data_keep_their_values_across_calls(hold):
    (m1, o1), (m2, o2) = _twins(lambda m: m.to(DEV))
    data = make_batches("gpt", 5)
    step = compiled_step(m2, o2)
    train_lazy(m1, o1, data[:3])
    train_compiled(step, data[:3])
    p = m2.blocks[0].ln_1.weight
    node = _node(p)
    assert type(node) is ir.PackedData and node.pack.array is not None
    expected = m1.blocks[0].ln_1.weight.detach().cpu().clone()  # p now (reading p would cut)
    if hold == "shared":
        # Shares p's data node until one of them is written: the call must cut it out of its
        # pack before it consumes the packed array.
        held = torch.empty_like(p)
        held.copy_(p.detach())
        assert _node(held) is node
    else:
        held = p.detach() * 0.5 + 0  # a lazy computation reading p, not run yet
        expected = expected * 0.5
    train_lazy(m1, o1, data[3:4])
    train_compiled(step, data[3:4])
    torch.testing.assert_close(held.cpu(), expected, **ADAM_TOL)
    assert not torch.allclose(p.detach().cpu(), expected)  # the step did update p
    train_lazy(m1, o1, data[4:])
    train_compiled(step, data[4:])  # and the calls go on
    assert_models_close(m1, m2, **ADAM_TOL)
    assert step.traces == 2


def test_state_loaded_between_calls_is_what_the_next_call_reads():
    (m1, o1), (m2, o2) = _twins(_fsdp)
    data = make_batches("gpt", 6)
    step = compiled_step(m2, o2)
    lazy = train_lazy(m1, o1, data[:3])
    compiled = train_compiled(step, data[:3])
    assert _layouts(step)
    torch.manual_seed(7)
    fresh = make_model("gpt", seed=7).state_dict()
    m1.load_state_dict(fresh)
    m2.load_state_dict(fresh)
    lazy += train_lazy(m1, o1, data[3:])
    compiled += train_compiled(step, data[3:])
    torch.testing.assert_close(compiled, lazy, **ADAM_TOL)
    assert_models_close(m1, m2, **ADAM_TOL)
    assert_state_close(o1, o2, **ADAM_TOL)
    assert step.traces == 2


def test_memory_counts_a_pack_once_and_does_not_cut_it(monkeypatch):
    data = [tuple(t.to(DEV) for t in b) for b in make_batches("gpt", 4)]
    totals = {}
    for packed in (True, False):
        if not packed:
            monkeypatch.setattr(packing, "MIN_PACKED", 10 ** 9)
        gc.collect()
        xshard.wait()
        start = sum(xshard.memory.live_bytes_per_device().values())
        model = _fsdp(make_model("gpt"))
        opt = _adamw(model)
        step = compiled_step(model, opt)
        for b in data:
            loss = step(*b)
        xshard.wait()
        assert bool(_layouts(step)) is packed
        p = model.blocks[0].ln_1.weight
        totals[packed] = (sum(xshard.memory.live_bytes_per_device().values()) - start,
                          type(_node(p)) is ir.PackedData and _node(p).pack.array is not None)
        del model, opt, step, loss, p
        gc.collect()  # the modules' reference cycles
    assert totals[True][1]  # still packed: counting read no member
    # The same state, packed or not (the packs' rows hold exactly the members' blocks).
    assert totals[True][0] == totals[False][0]


class _Mixed(nn.Module):
    """Float32 layers with bfloat16 scales: state of two dtypes, packed apart."""

    def __init__(self, n=8, d=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(d, dtype=torch.bfloat16))
                                       for _ in range(n))

    def forward(self, x, y):
        for layer, s in zip(self.layers, self.scales):
            x = torch.tanh(layer(x)) * s.float()
        return ((x - y) ** 2).mean()


def test_state_of_two_dtypes_makes_two_packs(monkeypatch):
    torch.manual_seed(0)
    base = _Mixed()
    m1, m2 = copy.deepcopy(base).to(DEV), copy.deepcopy(base).to(DEV)
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (m1, m2))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(5)]
    step = compiled_step(m2, o2)
    compiled = train_compiled(step, data)
    monkeypatch.setattr(packing, "MIN_PACKED", 10 ** 9)
    plain = train_compiled(compiled_step(m1, o1), data)
    assert sorted(str(layout.dtype) for layout in _layouts(step)) == ["bfloat16", "float32"]
    torch.testing.assert_close(compiled, plain, rtol=1e-6, atol=1e-6)
    assert_models_close(m1, m2, rtol=0, atol=0)


def test_small_or_large_state_is_not_packed(monkeypatch):
    model = make_model("mlp").to(DEV)  # 4 parameters, 4 momentum buffers: below MIN_PACKED
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = compiled_step(model, opt)
    train_compiled(step, make_batches("mlp", 4))
    assert step._last.packed is False
    # Blocks over MAX_PACKED_BYTES stay out of the packs (a pack writes its members once more).
    monkeypatch.setattr(packing, "MAX_PACKED_BYTES", 4096)
    model = make_model("gpt").to(DEV)
    opt = _adamw(model)
    step = compiled_step(model, opt)
    train_compiled(step, make_batches("gpt", 4))
    members = [m for layout in _layouts(step) for m in layout.members]
    assert len(members) >= packing.MIN_PACKED and all(m.size * 4 <= 4096 for m in members)
    assert type(_node(model.blocks[0].attn.qkv.weight)) is not ir.PackedData
    assert type(_node(model.blocks[0].ln_1.weight)) is ir.PackedData


def test_checkpoint_saves_and_loads_packed_state(tmp_path):
    (m1, o1), (m2, o2) = _twins(_fsdp)
    data = make_batches("gpt", 6)
    step = compiled_step(m2, o2)
    lazy = train_lazy(m1, o1, data[:3])
    compiled = train_compiled(step, data[:3])
    assert type(_node(m2.blocks[0].ln_1.weight)) is ir.PackedData
    xcp.save({"model": m2.state_dict()}, tmp_path / "ckpt")  # reads the packed parameters
    lazy += train_lazy(m1, o1, data[3:4])
    compiled += train_compiled(step, data[3:4])
    for m in (m1, m2):  # back to the saved parameters, written into the packed ones in place
        xcp.load({"model": m.state_dict()}, tmp_path / "ckpt")
    lazy += train_lazy(m1, o1, data[4:])
    compiled += train_compiled(step, data[4:])
    torch.testing.assert_close(compiled, lazy, **ADAM_TOL)
    assert_models_close(m1, m2, **ADAM_TOL)
    assert step.traces == 2
