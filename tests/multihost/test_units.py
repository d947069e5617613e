"""Single-process pieces of the multi-process support: positions, digests, settings, state dict
entries, the upload and read paths (no second process needed)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import xshard
import xshard.spmd as xs
from tests.multihost.conftest import clean_env
from xshard.core import arrays, distributed, divergence, runtime
from xshard.core.runtime import DistributedSettings
from xshard.fsdp import IncompleteShardsError, ShardedEntry, to_full
from xshard.spmd import loader, sharded_tensor, sharding


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    platform: str = "cpu"


FAKE = tuple(FakeDevice(i, 0) for i in range(4)) + tuple(FakeDevice(2048 + i, 1) for i in range(4))


@pytest.fixture
def two_process_ids(monkeypatch):
    """The device list of process 1 of a 2 x 4 run: JAX ids 0-3 and 2048-2051."""
    runtime._positions.cache_clear()
    monkeypatch.setattr(runtime, "devices", lambda: FAKE)
    monkeypatch.setattr(runtime, "local_devices", lambda: FAKE[4:])
    yield
    runtime._positions.cache_clear()


def test_positions_not_ids(two_process_ids):
    assert [runtime.position(d) for d in FAKE] == list(range(8))
    assert sharded_tensor._device_name(FAKE[5]) == "CPU:5"


def test_minibatch_tiles_use_positions(two_process_ids):
    mesh = xs.Mesh(np.arange(8), (8,), ("data",))
    assert loader._local_tiles_dim0(sharding.annotation(mesh, ("data", None), 2)) == 4
    mesh2 = xs.Mesh(np.arange(8), (4, 2), ("data", "model"))
    assert loader._local_tiles_dim0(sharding.annotation(mesh2, ("data", None), 2)) == 2


def test_sharding_string_names_positions(two_process_ids):
    jax = runtime.jax_module()
    order = [4, 5, 6, 7, 0, 1, 2, 3]
    real = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array([jax.devices()[i] for i in order]), ("x",)),
        jax.sharding.PartitionSpec("x"))

    class Fake:  # the real HLO sharding, over process 1's view of the device list
        _to_xla_hlo_sharding = real._to_xla_hlo_sharding
        _device_assignment = [FAKE[i] for i in order]

    assert sharding.hlo_string_of_jax_sharding(Fake(), 2) == "{devices=[8,1]4,5,6,7,0,1,2,3}"


DIGEST = textwrap.dedent("""
    import numpy as np, torch, xshard, xshard.spmd as xs
    from xshard.core import compiler, divergence, execute
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model = model.to(xshard.device())
    mesh = xs.Mesh(np.arange(8), (4, 2), ("data", "model"))
    xs.mark_sharding(model[0].weight, mesh, ("model", None))
    x = torch.randn(8, 8).to(xshard.device())
    xs.mark_sharding(x, mesh, ("data", None))
    model(x).square().mean().backward()
    step = execute.PendingStep()
    donating = compiler.lower(step.graph, donate=tuple(range(len(step.graph.inputs))))
    plain = compiler.lower(step.graph)
    assert divergence.program_digest(donating) == divergence.program_digest(plain)
    assert donating.as_text() != plain.as_text()
    print([divergence.program_digest(plain)])
""")


def test_program_digest_is_independent_of_python_hash_seed():
    outs = []
    for seed in ("1", "4242"):
        run = subprocess.run([sys.executable, "-c", DIGEST], capture_output=True, text=True,
                             timeout=120, env=clean_env({"PYTHONHASHSEED": seed,
                                                         "XSHARD_CPU_DEVICES": "8"}))
        assert run.returncode == 0, run.stderr[-3000:]
        outs.append(run.stdout.strip())
    assert outs[0] == outs[1]
    digests = eval(outs[0])  # noqa: S307  (a list of hex strings printed by the child)
    assert digests and all(len(d) == 16 and int(d, 16) >= 0 for d in digests)


def test_sample_digest():
    a = np.arange(100, dtype=np.float32)
    assert divergence.sample_digest(a) == divergence.sample_digest(a.copy())
    b = a.copy()
    b[7] += 1
    assert divergence.sample_digest(b) != divergence.sample_digest(a)
    assert divergence.sample_digest(a.reshape(10, 10)) != divergence.sample_digest(a)
    assert divergence.sample_digest(a.astype(np.int32)) != divergence.sample_digest(a)
    big = np.zeros(10_000_000, np.float32)  # sampled: at most 16 Ki elements read
    assert len(divergence.sample_digest(big)) == 16


def settings(**kw) -> DistributedSettings:
    return DistributedSettings(**kw)


@pytest.mark.parametrize("args, env, expected", [
    ((None, None, None), {}, None),
    (("10.0.0.1:1234", 4, 2), {}, ("arguments", "10.0.0.1:1234", 4, 2, ("10.0.0.1", 1235))),
    ((None, None, None), dict(coordinator_address="127.0.0.1:5", num_processes=2, process_id=1,
                              master_addr="127.0.0.1", master_port=6),
     ("xshard.launch (XSHARD_* variables)", "127.0.0.1:5", 2, 1, ("127.0.0.1", 6))),
    ((None, None, None), dict(rank=3, world_size=4, master_addr="h", master_port=9),
     ("torchrun (RANK/WORLD_SIZE/MASTER_ADDR)", None, 4, 3, ("h", 9))),
    ((None, None, 0), dict(num_processes=2, process_id=1, coordinator_address="a:1"),
     ("arguments", "a:1", 2, 0, ("a", 2))),
    ((None, None, None), dict(cluster="slurm"), ("slurm", None, None, None, None)),
])
def test_resolve(args, env, expected):
    plan = distributed._resolve(*args, settings(**env))
    if expected is None:
        assert plan is None
    else:
        assert (plan.source, plan.coordinator, plan.num_processes, plan.process_id,
                plan.store) == expected


@pytest.mark.parametrize("args, env, message", [
    (("a:1", None, None), {}, "needs num_processes and process_id"),
    ((None, 2, 0), {}, "needs coordinator_address"),
    (("a:1", 2, 2), {}, r"process_id must be an int in \[0, 2\)"),
    (("nohostport", 2, 0), {}, "must be 'host:port'"),
    ((None, None, None), dict(rank=0, world_size=2), "MASTER_ADDR/MASTER_PORT are not"),
])
def test_resolve_errors(args, env, message):
    with pytest.raises(distributed.InitializationError, match=message):
        distributed._resolve(*args, settings(**env))


def test_settings_validate(monkeypatch):
    monkeypatch.setenv("XSHARD_SYNC_TIMEOUT", "soon")
    runtime.distributed_settings.cache_clear()
    try:
        with pytest.raises(runtime.RuntimeConfigError, match="XSHARD_SYNC_TIMEOUT='soon'"):
            runtime.distributed_settings()
        monkeypatch.setenv("XSHARD_SYNC_TIMEOUT", "5")
        monkeypatch.setenv("XSHARD_CHECK", "sometimes")
        runtime.distributed_settings.cache_clear()
        with pytest.raises(runtime.RuntimeConfigError, match="valid values: \\['always', 'off'\\]"):
            runtime.distributed_settings()
    finally:
        monkeypatch.undo()
        runtime.distributed_settings.cache_clear()


def test_sharded_entry_refuses_missing_blocks():
    blocks = [((slice(0, 2), slice(0, 3)), torch.ones(2, 3)),
              ((slice(2, 4), slice(0, 3)), torch.zeros(2, 3))]
    whole = ShardedEntry((4, 3), torch.float32, "{devices=[2,1]0,1}", blocks)
    assert whole.complete and torch.equal(whole.full()[:2], torch.ones(2, 3))
    half = ShardedEntry((4, 3), torch.float32, "{devices=[2,1]0,1}", blocks[:1], process_index=1)
    assert not half.complete and half.covered == 6
    with pytest.raises(IncompleteShardsError, match="entry 'w': this entry holds 1 blocks "
                                                    "covering 6 of 12 elements"):
        to_full({"w": half})
    replicated = ShardedEntry((4,), torch.float32, "", [(Ellipsis, torch.ones(4))])
    assert replicated.complete


@pytest.fixture
def pretend_multiprocess(monkeypatch):
    """The upload and read paths of a multi-process run, in this single process."""
    monkeypatch.setattr(distributed, "ACTIVE", True)
    yield
    divergence._take_uploads()


def test_put_builds_arrays_from_local_blocks(pretend_multiprocess):
    jax = runtime.jax_module()
    host = np.arange(32, dtype=np.float32).reshape(8, 4)
    mesh = jax.sharding.Mesh(np.array(runtime.devices()), ("x",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    array = arrays.put(host, sharded, label="demo")
    assert array.sharding == sharded
    np.testing.assert_array_equal(arrays.to_host(array), host)
    _, records, count = divergence._take_uploads()
    assert count == 1 and records[0][0] == "demo" and "test_units.py:" in records[0][1]


def test_collected_uploads_join_the_check_where_used(pretend_multiprocess):
    with divergence.collect_uploads() as records:
        divergence.record_upload(np.ones(3, np.float32))
    assert len(records) == 1 and divergence._take_uploads()[2] == 0
    divergence.add_uploads(records)
    assert divergence._take_uploads()[2] == 1


class _Shard:
    def __init__(self, index, data):
        self.index, self.data = index, data


class _Array:
    def __init__(self, shape, shards):
        self.shape, self.dtype, self.addressable_shards = shape, np.dtype(np.float32), shards


def test_local_shards_cover_or_not():
    full = np.arange(16, dtype=np.float32).reshape(4, 4)
    rows = [_Shard((slice(i, i + 2), slice(None)), full[i:i + 2]) for i in (0, 2)]
    np.testing.assert_array_equal(arrays._from_local_shards(_Array((4, 4), rows)), full)
    assert arrays._from_local_shards(_Array((4, 4), rows[:1])) is None
    twice = [rows[0], rows[0]]  # replicas of one block cover it once
    assert arrays._from_local_shards(_Array((4, 4), twice)) is None


def test_single_process_helpers():
    assert xshard.is_main_process() and xshard.local_device_count() == xshard.device_count()
    assert distributed.is_library_file(xshard.__file__)
    assert not distributed.is_library_file(__file__)
    assert "test_units.py:" in divergence.site()


def test_minibatch_refuses_a_mesh_without_local_devices(two_process_ids):
    mesh = xs.Mesh(np.arange(4), (4,), ("data",))  # process 0's devices only
    spec = xs.ShardingSpec(mesh, ("data", None), minibatch=True)
    with pytest.raises(RuntimeError, match=r"has none of this process's devices \(positions "
                                           r"\[4, 5, 6, 7\]\)"):
        loader._upload_minibatch(torch.zeros(4, 2), spec, spec.annotation(2))


@pytest.mark.parametrize("mesh, spec, match", [
    # the batch axis inside each process, the model axis across them: every block on both
    (xs.Mesh(np.arange(8), (2, 4), ("model", "data")), ("data", None),
     r"block 0 of dimension 0 \(of 4\) is held by devices of processes \[0, 1\]"),
    (xs.Mesh(np.arange(8), (8,), ("data",)), (None, None), r"processes \[0, 1\] under"),
    (xs.Mesh(np.arange(8)[::-1], (8,), ("data",)), ("data", None),
     r"blocks of dimension 0 on processes \[1, 1, 1, 1, 0, 0, 0, 0\]"),
    (xs.Mesh([4, 5, 6, 7, 0, 1, 2, 3], (2, 4), ("data", "model")), ("data", None),
     r"on processes \[1, 0\] in row order"),
])
def test_minibatch_refuses_blocks_not_in_process_order(two_process_ids, mesh, spec, match):
    """Silent before: each process took the other's rows as its own (a loss over half the batch,
    different on each process), or rows in the mesh's device order."""
    spec = xs.ShardingSpec(mesh, spec, minibatch=True)
    with pytest.raises(ValueError, match=match):
        loader._upload_minibatch(torch.zeros(8, 2), spec, spec.annotation(2))


@pytest.mark.parametrize("shape, axes, spec", [
    ((8,), ("data",), ("data", None)),
    ((2, 4), ("data", "model"), ("data", "model")),
    ((4, 2), ("data", "model"), ("data", None)),
    ((2, 4), ("dcn", "ici"), (("dcn", "ici"), None)),
])
def test_minibatch_accepts_blocks_in_process_order(two_process_ids, shape, axes, spec):
    spec = xs.ShardingSpec(xs.Mesh(np.arange(8), shape, axes), spec, minibatch=True)
    loader._check_process_blocks(spec, spec.annotation(2))


def test_the_world_is_chosen_before_the_devices_are_used():
    with pytest.raises(ValueError, match="world='galaxy' is not a world xshard knows; valid "
                                         "values: 'global'"):
        xshard.initialize(world="galaxy")
    xshard.device_count()  # the devices are in use in this process
    with pytest.raises(RuntimeError, match="the local world must be chosen before the devices "
                                           "are first used"):
        runtime.use_local_world()
    assert not runtime.local_world()
