"""Graph execution: one graph per sync, an executable cache keyed by structure, Python scalars as
inputs, donation of overwritten buffers, asynchronous dispatch, metrics and HLO introspection."""

import logging
import re
import threading

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xshard
from core_testing import DEV, assert_same, counting
from xshard.core import compiler, execute, ir, lowering, metrics
from xshard.core import tensor as xt


def fresh(*shape):
    t = torch.randn(*shape).to(DEV)
    xshard.sync()
    return t


def test_nothing_runs_until_sync_or_read():
    a = fresh(4, 4)
    with counting() as d:
        b = (a @ a).relu() + 1
        c = b.sum(0)
        a.mul_(2)
        _ = b.shape, b.dtype, c.dim()  # metadata needs no execution
    assert d["executions"] == 0 and d["compiles"] == 0
    with counting() as d:
        xshard.sync()
    assert d["executions"] == 1  # one graph computes b, c and the new a
    with counting() as d:
        b.cpu(), c.cpu(), a.cpu()  # already computed
        xshard.sync()  # nothing pending
    assert d["executions"] == 0


def test_read_runs_one_graph_for_everything_pending():
    a = fresh(3)
    x, y = a + 1, a * 2
    with counting() as d:
        x.cpu()
    assert d["executions"] == 1
    with counting() as d:
        y.cpu()
    assert d["executions"] == 0


def test_cache_keyed_by_structure_not_data():
    def step(t):
        return (t * 3).exp().sum(0)

    a, b = fresh(5, 7), fresh(5, 7)
    first = step(a)
    xshard.sync()
    with counting() as d:
        out = step(b)
        xshard.sync()
    assert d["compiles"] == 0 and d["cache_hits"] == 1
    assert_same(out, (b.cpu() * 3).exp().sum(0))
    c = fresh(6, 7)
    with counting() as d:
        other = step(c)
        xshard.sync()
    assert d["compiles"] == 1  # another shape: another program
    assert_same(first, (a.cpu() * 3).exp().sum(0))
    assert_same(other, (c.cpu() * 3).exp().sum(0))


def test_cache_keeps_the_most_recently_used_programs(monkeypatch):
    """At most XSHARD_CACHE_SIZE executables are kept, the least recently used dropped (each holds
    memory mappings: unbounded, a process compiling tens of thousands of shapes ran out of them
    and XLA's compiler failed)."""
    from xshard.core import runtime

    def run(n):
        (torch.arange(float(n), device=DEV) * 2 + 1).sum().cpu()

    monkeypatch.setenv("XSHARD_CACHE_SIZE", "3")
    runtime.cache_limit.cache_clear()
    try:
        for n in (101, 102, 103):  # the cache is trimmed to these at the first compile
            run(n)
        assert compiler.cache_size() == 3
        with counting() as d:
            run(101)  # the least recently used: used now, so 102 goes next
            run(104)
            run(101)
        assert (d["cache_hits"], d["compiles"], compiler.cache_size()) == (2, 1, 3)
        with counting() as d:
            run(102)
        assert d["compiles"] == 1
        monkeypatch.setenv("XSHARD_CACHE_SIZE", "many")
        runtime.cache_limit.cache_clear()
        with pytest.raises(runtime.RuntimeConfigError, match="XSHARD_CACHE_SIZE='many' must be"):
            runtime.cache_limit()
    finally:
        monkeypatch.delenv("XSHARD_CACHE_SIZE")
        runtime.cache_limit.cache_clear()
    assert runtime.cache_limit() == runtime.DEFAULT_CACHE_SIZE


def test_calls_differing_only_in_argument_structure_get_their_own_shapes():
    # Flattened, sum(x, [0, 1]) and sum(x, [0], True) have equal static arguments (True == 1).
    x = torch.randn(4, 5, 6)
    d = x.to(DEV)
    for result, expected in ((d.sum((0, 1)), x.sum((0, 1))),
                             (d.sum(0, keepdim=True), x.sum(0, keepdim=True)),
                             (d.sum(dim=0), x.sum(dim=0)), (d.sum(0), x.sum(0)),
                             (d.sum(dim=(0,), keepdim=True), x.sum(dim=(0,), keepdim=True))):
        assert_same(result, expected)


def test_python_scalars_are_inputs():
    a = fresh(4)
    with counting() as d:
        for scale in (0.5, 1.5, 2.5, -3.0):
            out = a * scale + scale
            xshard.sync()
            assert_same(out, a.cpu() * scale + scale)
    assert d["compiles"] <= 1


def test_lr_scheduler_compiles_once():
    torch.manual_seed(0)
    ref = nn.Linear(6, 2)
    model = nn.Linear(6, 2)
    model.load_state_dict(ref.state_dict())
    model.to(DEV)
    runs = []
    for m in (ref, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        runs.append((m, opt, sched))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)) for _ in range(5)]
    compiles = []
    for x, y in data:
        for m, opt, sched in runs:
            dev = next(m.parameters()).device
            with counting() as d:
                F.mse_loss(m(x.to(dev)), y.to(dev)).backward()
                opt.step()
                opt.zero_grad()
                sched.step()
                if dev == DEV:
                    xshard.sync()
            if dev == DEV:
                compiles.append(d["compiles"])
    assert runs[1][1].param_groups[0]["lr"] == pytest.approx(0.5 / 6)
    assert compiles[2:] == [0, 0, 0]  # step 1 creates the momentum buffers, step 2 reads them
    assert_same(model.weight, ref.weight, rtol=1e-5, atol=1e-6)


def test_donation_frees_overwritten_buffers():
    torch.manual_seed(0)
    model = nn.Linear(16, 16).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = fresh(4, 16)
    for _ in range(2):  # reach the steady state
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        xshard.sync()
    old = model.weight._cell.value.payload
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    xshard.sync()
    new = model.weight._cell.value.payload
    assert new is not old
    assert old.is_deleted(), "the step's input buffer of the weight was not donated"
    assert not new.is_deleted()
    # A buffer that some live tensor still holds is never donated.
    keep = model.weight.detach().clone()
    xshard.sync()
    held = keep._cell.value.payload
    model(x).sum().backward()
    opt.step()
    xshard.sync()
    assert not held.is_deleted()
    assert torch.isfinite(keep.cpu()).all()


def test_each_update_reuses_the_buffer_of_the_data_it_replaces():
    # XLA pairs donated buffers with outputs by size; an update given the buffer of other data of
    # the same size makes it copy both (see [Note: inputs in the order of the outputs that replace
    # them] in xshard.core.graph).
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]).to(DEV)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = fresh(4, 16)
    for i in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if i < 2:  # the third step is looked at before it runs
            xshard.sync()
    step = execute.PendingStep()
    exe = compiler.executable(step.graph, step.donate)
    header = exe.compiled.as_text().split("\n", 1)[0]
    aliases = [(int(o), int(i)) for o, i in re.findall(r"\{(\d+)\}: \((\d+), \{\}", header)]
    replaces = {}
    for cell, output in zip(step.cells, step.owners):
        replaces.setdefault(output, cell.source)
    assert len(aliases) == len(step.donate) >= 24  # 8 parameters, each with 2 Adam buffers
    assert all(replaces[o] is step.graph.inputs[i] for o, i in aliases)
    xshard.sync()


BLOCK = "test.block_on_event"


def test_sync_returns_before_execution_finishes(monkeypatch):
    """Structural check of asynchrony: the graph holds a host callback that waits for an event the
    test only sets after sync() has returned; a blocking sync would time out inside the callback."""
    release = threading.Event()
    finished = threading.Event()

    def host(x):
        ok = release.wait(timeout=60)
        finished.set()
        return np.asarray(x + (1.0 if ok else -1000.0), np.float32)

    def rule(x):
        import jax
        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, np.float32), x)

    monkeypatch.setitem(lowering.RULES, BLOCK, rule)
    a = torch.zeros(()).to(DEV)
    xshard.sync()
    node = ir.Node(BLOCK, (a._value(),), ((ir.slot(0),), ()), (), torch.float32)
    out = xt.new_base(node)
    xshard.sync()
    assert not finished.is_set(), "sync() waited for the computation to finish"
    release.set()
    assert out.item() == 1.0  # reading waits, and sees the released computation
    assert finished.is_set()


def test_metrics_snapshot_and_report():
    snap = metrics.snapshot()
    for key in ("compiles", "cache_hits", "executions"):
        assert isinstance(snap[key], int)
    assert isinstance(snap["cpu_fallbacks"], dict)
    (fresh(3) + 2).cpu()
    text = metrics.report()
    assert "compiles" in text and "executions" in text and "cache hits" in text
    assert " s total" in text or "ms" in text
    metrics.reset()
    assert metrics.snapshot()["executions"] == 0
    (fresh(3) + 2).cpu()
    metrics.clear_metrics()  # the timings alone: no "0.0 ms each" over the counted executions
    assert "executions:      1 (0.0 ms dispatching)" in metrics.report()
    metrics.METRICS.executions = snap["executions"]  # leave the counters usable


def test_hlo_text_of_pending_tensors():
    a, b = fresh(4, 8), fresh(8, 3)
    out = (a @ b).tanh()
    with counting() as d:
        hlo = xshard.debug.hlo_text([out])
        compiled = xshard.debug.compiled_hlo_text(out)
    assert d["executions"] == 0
    assert "HloModule" in hlo and "dot(" in hlo and "tanh" in hlo
    assert "HloModule" in compiled and "ENTRY" in compiled
    with pytest.raises(TypeError, match="xshard tensors"):
        xshard.debug.hlo_text([torch.zeros(2)])
    assert_same(out, (a.cpu() @ b.cpu()).tanh(), rtol=1e-5, atol=1e-6)


def test_recompile_log_says_what_differs(caplog):
    def run(t):
        (t.sin() * 2).cpu()

    run(fresh(3, 5))
    caplog.set_level(logging.DEBUG, logger="xshard")
    run(fresh(4, 5))
    assert any("shape" in r.getMessage() and "(4, 5)" in r.getMessage() for r in caplog.records)
    caplog.clear()
    d = torch.randn(3, 5, dtype=torch.float64).to(DEV)
    xshard.sync()
    caplog.clear()
    run(d)
    assert any("dtype" in r.getMessage() for r in caplog.records)
    caplog.clear()
    (fresh(3, 5).cos() * 2).cpu()
    assert any("op" in r.getMessage() and "cos" in r.getMessage() for r in caplog.records)
    caplog.clear()
    run(fresh(3, 5))  # a cache hit logs nothing
    assert not [r for r in caplog.records if "recompiles" in r.getMessage()]


def test_cpu_fallback_counted_and_warned_once(monkeypatch):
    from xshard.core import fallback, ops

    op = torch.ops.aten.cosh.default
    monkeypatch.delitem(lowering.RULES, op)
    monkeypatch.setattr(fallback, "_WARNED", set())
    monkeypatch.setattr(ops, "_FACTS", {})
    try:
        a = fresh(4)
        with counting() as d:
            with pytest.warns(UserWarning, match=r"no lowering for \S*cosh\S*; it runs eagerly on CPU"):
                y = a.cosh()
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                z = (a * 2).cosh()  # warned once only
        # (aten.cosh decomposes to prims.cosh, which has no rule either: that one runs on CPU.)
        [(name, count)] = d["cpu_fallbacks"].items()
        assert "cosh" in name and count == 2
        assert metrics.snapshot()["cpu_fallbacks"][name] >= 2
        assert name in metrics.report()
        assert_same(y, a.cpu().cosh())
        assert_same(z, (a.cpu() * 2).cosh())
    finally:
        ops._FACTS.clear()


def test_failed_graph_does_not_block_later_syncs(monkeypatch):
    def broken(x):
        raise ValueError("boom")

    monkeypatch.setitem(lowering.RULES, "test.broken", broken)
    a = fresh(2)
    bad = xt.new_base(ir.Node("test.broken", (a._value(),), ((ir.slot(0),), ()), (2,),
                              torch.float32))
    good = a + 1
    with pytest.raises(lowering.LoweringError, match="boom"):
        xshard.sync()
    xshard.sync()  # the failing tensor is left out; the rest runs
    assert_same(good, a.cpu() + 1)
    with pytest.raises(lowering.LoweringError, match="boom"):
        bad.cpu()
    del bad


def test_graphs_differing_in_one_static_argument_do_not_share_an_executable():
    # hash(-1) == hash(-2) in CPython, and 1 == 1.0 == True: keys compare static arguments exactly.
    dev = xshard.device()
    x = torch.arange(12.).reshape(4, 3).to(dev)
    assert x[-1].cpu().tolist() == [9., 10., 11.]
    assert x[-2].cpu().tolist() == [6., 7., 8.]
    a = torch.randn(3, 3)
    d = a.to(dev)
    cases = [lambda t: t.softmax(-1), lambda t: t.softmax(-2), lambda t: t.pow(-1),
             lambda t: t.pow(-2), lambda t: torch.full_like(t, -1.), lambda t: torch.full_like(t, -2.),
             lambda t: torch.full_like(t, 0.), lambda t: torch.full_like(t, -0.),
             lambda t: t.cumsum(-1), lambda t: t.cumsum(-2), lambda t: t.roll(1, -1),
             lambda t: t.roll(1, -2), lambda t: t.tril(-1), lambda t: t.tril(-2),
             lambda t: t.sum([0, 1]), lambda t: t.sum([0], True), lambda t: t * 1, lambda t: t * True,
             lambda t: t * 1.0]
    for fn in cases:
        torch.testing.assert_close(fn(d).cpu(), fn(a), atol=1e-6, rtol=1e-6)
        assert torch.equal(torch.signbit(fn(d).cpu()), torch.signbit(fn(a)))


def test_same_values_merges_only_what_computes_the_same_value():
    # See [Note: values computed twice] in xshard/core/graph.py.
    from xshard.core.api import value
    from xshard.core.graph import same_values

    a, b = fresh(3), fresh(3)
    x1, x2 = a * 2 + 1, a * 2 + 1  # recorded twice: two nodes, one value
    other = b * 2 + 1  # the same ops on other data
    scaled = a * 2.5 + 1  # another scalar
    torch.manual_seed(0)
    r1 = torch.rand(3, device=DEV)
    r2 = torch.rand(3, device=DEV)  # the next draw of the stream: another value
    nodes = [value(t) for t in (x1, x2, other, scaled, r1, r2)]
    merged = same_values(nodes)
    assert merged[1] is merged[0] is nodes[0]
    assert [n is m for n, m in zip(nodes[2:], merged[2:])] == [True] * 4

    # _foreach_* results: element k from element k of each list; a list of scalars per element.
    steps = [fresh(()) for _ in range(3)]
    same = [s.clone() for s in [steps[0]] * 3]
    torch._foreach_add_(same, 1)
    assert len({id(n) for n in same_values([value(s) for s in same])}) == 1
    apart = [s.clone() for s in steps]
    torch._foreach_add_(apart, 1)
    assert len({id(n) for n in same_values([value(s) for s in apart])}) == 3
    by_list = [s.clone() for s in [steps[0]] * 3]
    torch._foreach_add_(by_list, [1.0, 2.0, 1.0])
    got = same_values([value(s) for s in by_list])
    assert got[2] is got[0] is not got[1]
    per_element = [s.clone() for s in [steps[0]] * 3]
    torch._foreach_mul_(per_element, (b * 3)[0])  # one 0-d tensor for every element
    assert len({id(n) for n in same_values([value(s) for s in per_element])}) == 1
