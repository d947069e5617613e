"""xm / xr / pl / xmp / torch_xla / fsdp names in one program (this 8-device test process, world
size 1), against eager CPU torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xshard
import xshard.compat as torch_xla
from xshard.compat import _world
from xshard.compat import fsdp as xfsdp
from xshard.compat import parallel_loader as pl
from xshard.compat import runtime as xr
from xshard.compat import xla_model as xm
from xshard.compat import xla_multiprocessing as xmp
from xshard.core import api

DEV = xshard.device()


@pytest.fixture(autouse=True)
def _clean():
    saved = xm.get_rng_state()
    yield
    _world._Mode.spmd = False
    xm._Closures.queue.clear()
    xm.set_rng_state(saved)


def test_devices_and_ordinals():
    assert xm.xla_device() == xm.xla_device(0) == torch_xla.device() == DEV
    assert xm.get_xla_supported_devices() == ["xshard:0"] and torch_xla.devices() == [DEV]
    assert xm.xla_device_hw(DEV) == xr.device_type() == "CPU"
    assert (xm.xrt_world_size(), xm.get_ordinal(), xm.get_local_ordinal()) == (1, 0, 0)
    assert xm.is_master_ordinal() and xm.is_master_ordinal(local=False)
    assert (xr.world_size(), xr.global_ordinal(), xr.local_ordinal()) == (1, 0, 0)
    assert (xr.process_index(), xr.process_count(), xr.host_index()) == (0, 1, 0)
    assert xr.global_runtime_device_count() == xr.global_device_count() == 8
    assert xr.addressable_runtime_device_count() == xr.local_device_count() == 8
    assert xr.addressable_device_count() == torch_xla.device_count() == 1
    assert xr.using_pjrt()
    with pytest.raises(ValueError, match=r"xm.xla_device\(n=1\): xshard has one logical device"):
        xm.xla_device(1)
    with pytest.raises(ValueError, match="this process's devices are CPU"):
        xm.xla_device(devkind="TPU")
    with pytest.raises(ValueError, match="is not an xshard device"):
        xm.xla_device_hw("cpu")


def test_use_spmd_is_one_program():
    assert not xr.is_spmd()
    xr.use_spmd()
    assert xr.is_spmd() and xr.world_size() == 1
    with pytest.raises(ValueError, match=r"xmp.spawn\(nprocs=2\) after xr.use_spmd\(\)"):
        xmp.spawn(print, nprocs=2)
    with pytest.raises(NotImplementedError, match="automatic sharding"):
        xr.use_spmd(auto=True)


def test_master_print(capsys):
    xm.master_print("hello", 3, flush=True)
    assert capsys.readouterr().out == "hello 3\n"


def test_mark_step_runs_the_step_then_closures_in_order():
    x = torch.arange(4.0).to(DEV) * 2
    seen = []
    xm.add_step_closure(lambda t: seen.append(("a", api.settled(t), t.cpu().tolist())), args=(x,))
    xm.add_step_closure(lambda: seen.append(("b",)), run_async=True)
    assert seen == [] and not api.settled(x)
    torch_xla.sync()
    assert seen == [("a", True, [0.0, 2.0, 4.0, 6.0]), ("b",)]
    xm.mark_step()
    assert len(seen) == 2  # closures run once
    with pytest.raises(TypeError, match="add_step_closure needs a callable"):
        xm.add_step_closure(3)
    with torch_xla.step():
        y = x + 1
    assert api.settled(y)
    xm.wait_device_ops()


def test_compile_makes_the_code_one_step_in_every_form():
    """torch_xla.compile: what came before is synced first, the code's ops are one step, synced
    at the end (then the step closures); the values are eager's."""
    x = torch.arange(6.0).reshape(2, 3)
    before = x.to(DEV) * 3

    def f(t):
        assert api.settled(before)  # synced on entry
        return (t.sin() @ t.T).relu()

    expected = (x.sin() @ x.T).relu()
    for compiled in (torch_xla.compile(f), torch_xla.compile()(f), torch_xla.compile(f, name="g")):
        got = compiled(x.to(DEV))
        assert api.settled(got) and torch.allclose(got.cpu(), expected)
        before = x.to(DEV) * 3
    seen = []
    with torch_xla.compile():
        y = x.to(DEV).cos()
        xm.add_step_closure(lambda: seen.append(api.settled(y)))
    assert seen == [True] and torch.allclose(y.cpu(), x.cos())
    with torch_xla.step():
        z = y + 1
    assert api.settled(z)


def test_compile_names_its_programs():
    from xshard.core import trace

    torch_xla.compile(lambda t: t * 5 + 1, name="my step")(torch.ones(7, 5).to(DEV))
    assert trace._last_name.startswith("xshard_my_step_")


def test_compile_full_graph_refuses_what_would_run_early():
    x = torch.arange(4.0).to(DEV)

    def reads(t):
        return (t * 2).sum().item()

    def prints(t):
        print(t + 1)

    def syncs(t):
        t = t * 2
        xm.mark_step()
        return t

    def falls_back(t):
        return torch.linalg.eig(t.reshape(2, 2))

    for f, what in ((reads, r"\.item\(\)"), (prints, "print"), (syncs, "a sync"),
                    (falls_back, "linalg_eig.* no lowering rule")):
        with pytest.raises(RuntimeError, match=rf"full_graph=True\): .*{what}.* at "
                                               rf".*test_compat_api.py:\d+"):
            torch_xla.compile(f, full_graph=True)(x)
    assert torch_xla.compile(reads)(x) == 12.0  # full_graph=False lets it run
    inner = torch_xla.compile(lambda t: t * 2)  # its syncs are refused, at the caller's line
    with pytest.raises(RuntimeError, match=r"a sync .* at .*test_compat_api.py:\d+: inner\(x\)"):
        with torch_xla.compile(full_graph=True):
            inner(x)
    out = torch_xla.compile(lambda t: t.exp(), full_graph=True)(x)
    assert torch.allclose(out.cpu(), torch.arange(4.0).exp())


def test_compile_max_different_graphs():
    f = torch_xla.compile(lambda t: t.tanh() * 2, max_different_graphs=1)
    for _ in range(3):
        assert torch.allclose(f(torch.ones(3).to(DEV)).cpu(), torch.ones(3).tanh() * 2)
    with pytest.raises(RuntimeError, match="max_different_graphs=1, but it has run 2 different"):
        f(torch.ones(4).to(DEV))
    with pytest.raises(ValueError, match="max_different_graphs=0.*positive int"):
        torch_xla.compile(max_different_graphs=0)


def test_fork_rng_puts_the_stream_back():
    xm.set_rng_state(7)
    first = torch.rand(3, device=DEV).cpu()
    xm.set_rng_state(7)
    with xm.fork_rng():
        inside = torch.rand(3, device=DEV).cpu()
        torch.rand(5, device=DEV)
    assert torch.equal(torch.rand(3, device=DEV).cpu(), first) and torch.equal(inside, first)
    xm.set_rng_state(7)
    with xm.fork_rng(enabled=False):
        torch.rand(3, device=DEV)
    assert not torch.equal(torch.rand(3, device=DEV).cpu(), first)


def test_get_memory_info_counts_live_buffers():
    empty = xm.get_memory_info()
    big = torch.zeros(8, 1 << 16).to(DEV)  # replicated: 2 MiB on every device
    info = xm.get_memory_info(DEV)
    assert set(info) >= {"bytes_used", "bytes_limit"}
    assert info["bytes_used"] - empty["bytes_used"] >= 8 << 18
    assert info["bytes_used"] < info["bytes_limit"]
    del big


def test_do_on_ordinals_hands_cpu_tensors():
    w = torch.arange(3.0).to(DEV) + 1
    got = xm.do_on_ordinals(lambda t, n: (t.device.type, t.tolist(), n), (w, 2))
    assert got == ("cpu", [1.0, 2.0, 3.0], 2)


def test_optimizer_step_is_the_step_with_one_replica():
    torch.manual_seed(0)
    cpu = torch.nn.Linear(4, 3)
    dev = torch.nn.Linear(4, 3)
    dev.load_state_dict(cpu.state_dict())
    dev.to(DEV)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (cpu, dev)]
    x = torch.randn(5, 4)
    for _ in range(2):
        for model, opt, data in ((cpu, opts[0], x), (dev, opts[1], x.to(DEV))):
            opt.zero_grad()
            model(data).square().sum().backward()
        opts[0].step()
        assert xm.optimizer_step(opts[1], barrier=True) is None
        assert api.settled(dev.weight)  # barrier=True ended the step
    for name, value in cpu.state_dict().items():
        torch.testing.assert_close(dev.state_dict()[name].cpu(), value)


def test_all_reduce_and_all_gather_with_one_replica():
    t = torch.tensor([1.0, 2.0]).to(DEV)
    out = xm.all_reduce(xm.REDUCE_SUM, t)
    assert out is not t and out.cpu().tolist() == [1.0, 2.0]
    assert xm.all_reduce(xm.REDUCE_MAX, t, scale=0.5).cpu().tolist() == [0.5, 1.0]
    items = [torch.ones(2).to(DEV), torch.full((3,), 4.0).to(DEV)]
    assert xm.all_reduce(xm.REDUCE_SUM, items, scale=0.25) is items
    assert [i.cpu().tolist() for i in items] == [[0.25, 0.25], [1.0, 1.0, 1.0]]
    assert xm.all_gather(t).cpu().tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match=r"reduce_type='avg' is not a reduction xm knows"):
        xm.all_reduce("avg", t)
    with pytest.raises(ValueError, match="a scale applies to floating-point tensors only"):
        xm.all_reduce(xm.REDUCE_SUM, torch.ones(2, dtype=torch.int64).to(DEV), scale=0.5)
    with pytest.raises(TypeError, match=r"input 0 is a Tensor on cpu, not an xshard tensor"):
        xm.all_reduce(xm.REDUCE_SUM, torch.ones(2))
    with pytest.raises(NotImplementedError, match="only one group of all 1 replicas"):
        xm.all_reduce(xm.REDUCE_SUM, t, groups=[[0], [1]])
    with pytest.raises(ValueError, match="at least one dimension"):
        xm.all_gather(torch.tensor(1.0).to(DEV))
    with pytest.raises(ValueError, match="dim=2 is out of range"):
        xm.all_gather(t, dim=2)


def test_scatter_all_to_all_permute_broadcast_with_one_replica():
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t = x.to(DEV)
    out = xm.reduce_scatter(xm.REDUCE_SUM, t, scale=0.5, scatter_dim=1, shard_count=1)
    assert out is not t and torch.equal(out.cpu(), x * 0.5)
    outs = xm.reduce_scatter(xm.REDUCE_MAX, [t, t[0]], 1.0, -1, 1)
    assert [o.cpu().tolist() for o in outs] == [x.tolist(), x[0].tolist()]
    into = torch.zeros(2, 3).to(DEV)
    assert xm.reduce_scatter(xm.REDUCE_SUM, t, 1.0, 0, 1, output=into) is into
    assert torch.equal(into.cpu(), x)
    assert torch.equal(xm.all_to_all(t, 1, 0, 1).cpu(), x)
    assert torch.equal(xm.collective_permute(t, [[0, 0]]).cpu(), x)
    assert torch.equal(xm.collective_permute(t, []).cpu(), torch.zeros(2, 3))
    xm.collective_broadcast([t], root_ordinal=0)
    assert torch.equal(t.cpu(), x)


@pytest.mark.parametrize("call, error, message", [
    (lambda t: xm.reduce_scatter(xm.REDUCE_SUM, t, 1.0, 0, 2), ValueError,
     r"shard_count=2\): shard_count must be the number of replicas, 1"),
    (lambda t: xm.reduce_scatter(xm.REDUCE_SUM, t, 1.0, 2, 1), ValueError,
     r"scatter_dim=2 is out of range for a 2-dim tensor of shape \[2, 3\]; valid: -2 to 1"),
    (lambda t: xm.reduce_scatter(xm.REDUCE_SUM, t, 1.0, 0.0, 1), TypeError,
     "scatter_dim must be an int, got 0.0"),
    (lambda t: xm.reduce_scatter("avg", t, 1.0, 0, 1), ValueError, "reduce_type='avg'"),
    (lambda t: xm.reduce_scatter(xm.REDUCE_SUM, [], 1.0, 0, 1), TypeError,
     "non-empty list"),
    (lambda t: xm.reduce_scatter(xm.REDUCE_SUM, [t, t[0]], 1.0, 1, 1), ValueError,
     r"scatter_dim=1 is out of range for a 1-dim tensor of shape \[3\]"),
    (lambda t: xm.reduce_scatter(xm.REDUCE_SUM, t, 1.0, 0, 1,
                                 output=torch.zeros(3, 2).to(DEV)), ValueError,
     r"output 0 is \[3, 2\] torch.float32; the result is \[2, 3\] torch.float32"),
    (lambda t: xm.reduce_scatter(xm.REDUCE_SUM, t.long(), 0.5, 0, 1), ValueError,
     "a scale applies to floating-point tensors only"),
    (lambda t: xm.all_to_all(t, 0, 3, 1), ValueError, "concat_dimension=3 is out of range"),
    (lambda t: xm.all_to_all(t, 0, 1, 4), ValueError, "split_count must be the number of"),
    (lambda t: xm.collective_permute(t, [[0, 1]]), ValueError,
     r"pair \(0, 1\) names a replica outside 0..0"),
    (lambda t: xm.collective_permute(t, [[0, 0], [0, 0]]), ValueError,
     "name a source more than once"),
    (lambda t: xm.collective_permute(t, [0, 1]), TypeError,
     r"pairs must be a list of \(source, target\) replica ordinals"),
    (lambda t: xm.collective_permute(t, [[0.0, 0]]), TypeError, "pairs must be a list"),
    (lambda t: xm.collective_broadcast([t], root_ordinal=1), ValueError,
     r"root_ordinal=1\): valid ordinals are 0 to 0"),
    (lambda t: xm.collective_broadcast([t.cpu()]), TypeError, "not an xshard tensor"),
])
def test_scatter_all_to_all_permute_broadcast_errors(call, error, message):
    with pytest.raises(error, match=message):
        call(torch.ones(2, 3).to(DEV))


def test_rendezvous_mesh_reduce_do_on_ordinals():
    assert xm.rendezvous("x", b"abc") == [b"abc"]
    got = xm.mesh_reduce("acc", {"v": torch.tensor([2.0]).to(DEV)}, lambda xs: xs)
    assert got[0]["v"].device.type == "cpu" and got[0]["v"].tolist() == [2.0]
    assert xm.do_on_ordinals(lambda a: a + 1, (1,)) == 2
    assert xm.do_on_ordinals(lambda: 1, ordinals=(5,)) is None
    with pytest.raises(TypeError, match="payload must be bytes"):
        xm.rendezvous("x", "text")
    assert xmp.MpSerialExecutor().run(lambda: 7) == 7
    model = torch.nn.Linear(2, 2)
    assert xmp.MpModelWrapper(model).to(DEV).weight.device == DEV


def test_save_writes_cpu_tensors(tmp_path):
    param = torch.nn.Parameter(torch.randn(3).to(DEV))
    data = {"p": param, "list": [torch.ones(2).to(DEV), "text", 4],
            "tuple": (torch.zeros(1).to(DEV),), "cpu": torch.ones(1)}
    xm.save(data, tmp_path / "a.pt")
    loaded = torch.load(tmp_path / "a.pt", weights_only=True)
    assert isinstance(loaded["p"], torch.nn.Parameter) and loaded["p"].device.type == "cpu"
    assert loaded["p"].tolist() == param.cpu().tolist()
    assert loaded["list"][0].device.type == "cpu" and loaded["list"][1:] == ["text", 4]
    assert isinstance(loaded["tuple"], tuple) and loaded["cpu"].tolist() == [1.0]
    xm.save({"x": 1}, tmp_path / "b.pt", master_only=False)
    assert torch.load(tmp_path / "b.pt") == {"x": 1}


def test_rng_state_round_trip():
    xm.set_rng_state(123)
    assert xm.get_rng_state() == 123
    a = torch.rand(4, device=DEV).cpu()
    state = xm.get_rng_state()
    assert state == 123 + (1 << 64)  # one random op drawn since seeding
    b = torch.rand(4, device=DEV).cpu()
    xm.set_rng_state(state)
    assert torch.equal(torch.rand(4, device=DEV).cpu(), b)
    xm.set_rng_state(123)
    assert torch.equal(torch.rand(4, device=DEV).cpu(), a)
    torch_xla.manual_seed(123)
    assert torch.equal(torch.rand(4, device=DEV).cpu(), a)
    for bad in (-1, 2 ** 130, 1.5):  # 2**130 was truncated, silently
        with pytest.raises(ValueError, match="int seed from 0 to 2"):
            xm.set_rng_state(bad)
    xm.set_rng_state(np.int64(123))  # numpy ints, as torch_xla's bindings take them
    assert torch.equal(torch.rand(4, device=DEV).cpu(), a)


def test_device_attributes_and_counts():
    assert xm.xla_device_kind() == xm.xla_device_kind(DEV) == "cpu"
    assert xr.is_bf16_supported() is True
    assert xr.runtime_device_attributes()["platform"] == "cpu"
    assert len(xr.global_runtime_device_attributes()) == 8
    before = xr.get_num_cached_compilation_graph()
    (torch.ones(3, 17).to(DEV) * 3.25).sum().item()  # a program no other test compiles
    assert xr.get_num_cached_compilation_graph() == before + 1


def test_rate_tracker():
    tracker = xm.RateTracker(smooth_factor=0.5)
    tracker.add(100)
    assert tracker.rate() > 0 and tracker.global_rate() > 0


def test_names_without_meaning_raise_with_the_replacement():
    with pytest.raises(AttributeError, match="set_replication has no counterpart.*xmp.spawn"):
        xm.set_replication
    with pytest.raises(AttributeError, match="send has no counterpart.*xm.collective_permute"):
        xm.send
    with pytest.raises(AttributeError, match="has no attribute 'nonexistent'"):
        xm.nonexistent
    with pytest.raises(AttributeError, match="_XLAC .* does not exist"):
        torch_xla._XLAC
    with pytest.raises(AttributeError, match="set PJRT_DEVICE before the process starts"):
        xr.set_device_type
    with pytest.raises(NotImplementedError, match="readonly=True"):
        xr.initialize_cache("/tmp/x", readonly=True)


def test_initialize_cache_is_jax_compilation_cache(tmp_path):
    from xshard.core import runtime

    jax = runtime.jax_module()
    before = jax.config.jax_compilation_cache_dir
    try:
        xr.initialize_cache(str(tmp_path))
        assert jax.config.jax_compilation_cache_dir == str(tmp_path)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_parallel_loader_syncs_before_each_batch():
    batches = [torch.full((2,), float(k)) for k in range(3)]
    model_input = torch.ones(2).to(DEV)
    xshard.sync()
    before = xshard.metrics.snapshot()["executions"]
    loader = pl.ParallelLoader(batches, [DEV]).per_device_loader(DEV)
    assert len(loader) == 3
    pending = []
    for batch in loader:
        assert batch.device == DEV
        pending.append(model_input * batch)  # left pending: the loader runs it before the next
        assert [api.settled(p) for p in pending[:-1]] == [True] * (len(pending) - 1)
        assert not api.settled(pending[-1])
    assert api.settled(pending[-1])  # and once more when the data runs out
    assert xshard.metrics.snapshot()["executions"] - before == 3
    assert list(loader) == []  # one pass, as torch_xla's
    assert [p.cpu().tolist() for p in pending] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    mp = pl.MpDeviceLoader(batches, DEV, batches_per_execution=2)
    assert len(mp) == 3
    assert [b.cpu().tolist() for b in mp] == [b.tolist() for b in batches]
    assert len(list(mp)) == 3  # a fresh pass each time
    with pytest.raises(ValueError, match="xshard has one device per process"):
        pl.ParallelLoader(batches, [DEV, DEV])
    with pytest.raises(ValueError, match="is not this process's device"):
        pl.MpDeviceLoader(batches, "cpu")
    with pytest.raises(ValueError, match="batches_per_execution must be a positive int"):
        pl.ParallelLoader(batches, [DEV], batches_per_execution=0)


def test_spawn_in_process_and_its_argument_errors():
    assert xmp.spawn(lambda i, a: (i, a, xm.xrt_world_size()), args=(5,), nprocs=1) == (0, 5, 1)
    assert torch_xla.launch(lambda i: i + 10, debug_single_process=True) == 10
    with pytest.raises(TypeError, match="sends fn and args to new processes by pickling"):
        xmp.spawn(lambda i: i, nprocs=2)
    with pytest.raises(ValueError, match=r"nprocs=0\): nprocs must be a positive int"):
        xmp.spawn(print, nprocs=0)
    with pytest.raises(TypeError, match=r"args=...\) must be a tuple"):
        xmp.spawn(print, args=5, nprocs=2)
    with pytest.raises(ValueError, match=r"join=False\) is not supported"):
        xmp.spawn(print, nprocs=2, join=False)
    with pytest.raises(ValueError, match="start_method='thread'"):
        xmp.spawn(print, nprocs=2, start_method="thread")
    # 'fork' starts fresh replicas as 'spawn' does: a model the parent built does not reach them
    # (unseeded, each replica initialised its own, silently), which the warning says.
    with pytest.warns(UserWarning, match=r"start_method='fork'.*broadcast_master_param"), \
            pytest.raises(ValueError, match=r"join=False\) is not supported"):
        xmp.spawn(print, nprocs=2, join=False, start_method="fork")


def test_xla_fsdp_is_xshard_fsdp_over_every_device():
    import xshard.spmd as xs
    from xshard.fsdp import FSDP

    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    dev = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    dev.load_state_dict(cpu.state_dict())
    wrapped = xfsdp.XlaFullyShardedDataParallel(
        dev, flatten_parameters=True, pin_layout_in_collective_ops=False,
        auto_wrap_policy=xfsdp.always_wrap_policy)
    assert wrapped is dev and isinstance(dev, FSDP)
    assert isinstance(dev, xfsdp.XlaFullyShardedDataParallel)
    assert xs.get_sharding_spec(dev[0].weight) == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    x = torch.randn(8, 8)
    torch.testing.assert_close(dev(x.to(DEV)).cpu(), cpu(x), rtol=1e-5, atol=1e-5)
    half = xfsdp.XlaFullyShardedDataParallel(torch.nn.Linear(8, 4), compute_dtype=torch.bfloat16)
    assert half(x.to(DEV)).dtype == torch.bfloat16 and half.weight.dtype == torch.float32
    free = xfsdp.XlaFullyShardedDataParallel(torch.nn.Linear(8, 4),
                                             optimization_barrier_in_forward=False)
    assert free._fsdp_fenced == {"forward": False, "backward": True}  # torch_xla's option, here
    with pytest.raises(TypeError, match="unknown option 'colour'"):
        xfsdp.XlaFullyShardedDataParallel(torch.nn.Linear(2, 2), colour=1)
    # torch_xla's recipe for checkpointing every unit
    ckpt = xfsdp.XlaFullyShardedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)),
        auto_wrap_policy=xfsdp.always_wrap_policy,
        auto_wrapper_callable=lambda m, *a, **k: xfsdp.XlaFullyShardedDataParallel(
            xfsdp.checkpoint_module(m), *a, **k))
    assert ckpt[0]._xshard_checkpointed and ckpt[1]._xshard_checkpointed
    with pytest.raises(NotImplementedError, match="nested wrapping"):
        xfsdp.XlaFullyShardedDataParallel(torch.nn.Sequential(dev))
    with pytest.raises(NotImplementedError, match="already holds whole tensors"):
        xfsdp.consolidate_sharded_model_checkpoints("prefix")
    assert dev.module is dev  # torch_xla's .module: FSDP wraps in place
    assert dev.get_shard_metadata()["shard_info"] == {}  # its checkpoint recipe runs


def test_fsdp_v2_with_torch_xla_signature_and_checkpointed_units():
    """FSDPv2(model, mesh) with torch_xla's positional mesh, and its documented recipe for
    checkpointing every unit through auto_wrapper_callable; trains as eager CPU."""
    import functools

    import xshard.spmd as xs
    from xshard.compat.fsdp import checkpoint_module, transformer_auto_wrap_policy
    from xshard.compat.fsdp.spmd import SpmdFullyShardedDataParallel as FSDPv2

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.drop = torch.nn.Linear(8, 8), torch.nn.Dropout(0.0)

        def forward(self, x):
            return x + self.drop(self.fc(x).tanh())

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(8, 2))

    mesh = xs.Mesh(list(range(8)), (8, 1), ("fsdp", "model"))
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    cpu = net()
    model = FSDPv2(net(), mesh, auto_wrap_policy=policy,
                   auto_wrapper_callable=lambda m, *a, **k: FSDPv2(checkpoint_module(m), *a, **k))
    assert model.module is model and model[0]._xshard_checkpointed and model[1]._xshard_checkpointed
    assert not getattr(model[2], "_xshard_checkpointed", False)
    assert xs.get_sharding_spec(model[0].fc.weight) == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (cpu, model)]
    for _ in range(3):
        x = torch.randn(16, 8)
        for m, opt, data in ((cpu, opts[0], x), (model, opts[1], x.to(DEV))):
            opt.zero_grad()
            m(data).square().mean().backward()
            opt.step()
    torch.testing.assert_close(model[0].fc.weight.cpu(), cpu[0].fc.weight.detach(),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"auto_wrapper_callable=...\) needs an auto_wrap_policy"):
        FSDPv2(net(), mesh, auto_wrapper_callable=lambda m, *a, **k: m)
    with pytest.raises(TypeError, match="returned another module than the Block"):
        FSDPv2(net(), mesh, auto_wrap_policy=policy, auto_wrapper_callable=lambda m, **k: Block())


def test_helpers_of_torch_xla_examples(capsys, tmp_path):
    """Names torch_xla's example scripts use: xm.send_cpu_data_to_device, xm.is_xla_tensor,
    xm._fetch_gradients (its AMP example) and torch_xla.test.test_utils."""
    from xshard.compat import test_utils

    batch = xm.send_cpu_data_to_device({"x": torch.ones(2), "y": [torch.zeros(1)]}, DEV)
    assert xm.is_xla_tensor(batch["x"]) and xm.is_xla_tensor(batch["y"][0])
    assert not xm.is_xla_tensor(torch.ones(1))
    model = torch.nn.Linear(2, 1).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert xm._fetch_gradients(opt) == []
    model(batch["x"]).sum().backward()
    assert [g.shape for g in xm._fetch_gradients(opt)] == [(1, 2), (1,)]
    test_utils.print_training(DEV, 3, torch.tensor(0.25, device=DEV), 10.0, 9.5, epoch=1)
    test_utils.print_test_update(DEV, 97.5, epoch=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| Training Device=xshard:0 Epoch=1 Step=3 Loss=0.25000 "
                               "Rate=10.00 GlobalRate=9.50 Time=")
    assert lines[1].startswith("| Test Device=xshard:0 Epoch=1 Accuracy=97.50 Time=")
    assert test_utils.get_summary_writer(None) is None
    test_utils.write_to_summary(None, 0, {"loss": 1.0})  # no writer: nothing
    written = []
    writer = type("Writer", (), {"add_scalar": lambda self, *a: written.append(a)})()
    test_utils.write_to_summary(writer, 5, {"acc": torch.tensor(0.5)}, write_xla_metrics=True)
    assert written[0] == ("acc", 0.5, 5) and all(w[0].startswith("xla/") for w in written[1:])
