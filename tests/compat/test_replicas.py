"""xm / xr / pl inside 2 replicas of ``xmp.spawn`` (scripts/replica_api.py), and replicas that go
wrong (scripts/replica_fail.py): a clear error on every side, within seconds, never a hang."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.compat.oracle import SCRIPTS
from tests.multihost.conftest import clean_env, run_command

pytestmark = pytest.mark.multihost


def _compat(*args: str, timeout: float = 180, env: dict | None = None):
    return run_command([sys.executable, "-m", "xshard.compat", *args], env=clean_env(env),
                       timeout=timeout, cwd=SCRIPTS)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    run = _compat("replica_api.py", str(out))
    assert run.returncode == 0, run.explain()
    results = run.results()
    assert sorted(results) == [0, 1], run.explain()
    return out, results


def test_who_is_who(api):
    _, results = api
    for r, res in results.items():
        assert res["device"] == res["torch_xla_device"] == "xshard:0"
        assert res["world"] == [2, 2]
        assert res["ordinal"] == [r, r, r, r, r, 2]
        assert res["master"] == [r == 0, r == 0]
        # 2 devices in the run, 1 in each replica's own world
        assert res["devices"] == [2, 1, 1, 1]
        assert res["device_type"] == "CPU" and res["is_spmd"] is False


def test_all_reduce_every_type(api):
    _, results = api
    f = [torch.tensor([1.0, -2.0, 3.0]) * r for r in (1, 2)]
    i = [torch.tensor([5, 6, 7]) * r for r in (1, 2)]
    b = [torch.tensor([True, True, False]), torch.tensor([True, False, False])]
    want = {
        "REDUCE_SUM": [(f[0] + f[1]).tolist(), (i[0] + i[1]).tolist()],
        "REDUCE_MAX": [torch.maximum(*f).tolist(), torch.maximum(*i).tolist()],
        "REDUCE_MIN": [torch.minimum(*f).tolist(), torch.minimum(*i).tolist()],
        "REDUCE_MUL": [(f[0] * f[1]).tolist(), (i[0] * i[1]).tolist()],
        "REDUCE_AND": [(b[0] & b[1]).tolist(), (i[0] & i[1]).tolist()],
        "REDUCE_OR": [(b[0] | b[1]).tolist(), (i[0] | i[1]).tolist()],
        "scaled": ((f[0] + f[1]) * 0.5).tolist(),
        "scalar": 7.5,
        "list": [True, [[3.0, 3.0], [3.0, 3.0]], [0, 3, 6], 3.0],
        "large": [[256, 257], [3.0]],
    }
    for res in results.values():
        assert res["all_reduce"] == want


def test_all_gather_rendezvous_mesh_reduce(api):
    _, results = api
    g = [torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r for r in (0, 1)]
    for res in results.values():
        assert res["all_gather"] == [torch.cat(g, 0).tolist(), torch.cat(g, 1).tolist()]
        assert res["all_gather_list"] == [torch.cat(g, 0).tolist(),
                                          torch.cat([g[0][0], g[1][0]]).tolist()]
        assert res["groups_any_order"] == [(g[0] + g[1]).tolist()] * 2
        assert res["rendezvous"] == ["from 0", "from 1"]
        assert res["mesh_reduce"] == [1.0, 2.0]


def test_reduce_scatter_all_to_all_permute_broadcast(api):
    _, results = api
    a = [torch.arange(8, dtype=torch.float32).reshape(4, 2) + 10 * r for r in (0, 1)]
    v = [torch.arange(6) * r for r in (1, 2)]
    flags = [torch.tensor([True, True, True, False]), torch.tensor([True, False, True, False])]
    for r, res in results.items():
        got = res["reduce_scatter"]
        assert got["sum"] == ((a[0] + a[1]) * 0.5).chunk(2, 0)[r].tolist()
        assert got["list"] == [(a[0] + a[1]).chunk(2, 1)[r].tolist(),
                               (v[0] + v[1]).chunk(2, 0)[r].tolist()]
        assert got["max"] == torch.maximum(a[0], -a[1]).chunk(2, 1)[r].tolist()
        assert got["mul"] == (a[0].long() * a[1].long()).chunk(2, 0)[r].tolist()
        assert got["and"] == (flags[0] & flags[1]).chunk(2, 0)[r].tolist()
        assert got["output"] == torch.minimum(a[0], a[1]).chunk(2, 1)[r].tolist()
        assert res["all_to_all"] == [
            torch.cat([a[0].chunk(2, 0)[r], a[1].chunk(2, 0)[r]], 1).tolist(),
            torch.cat([a[0].chunk(2, 1)[r], a[1].chunk(2, 1)[r]], 0).tolist()]
        assert res["permute"] == [a[1 - r].tolist(),
                                  (a[0] if r == 1 else torch.zeros(4, 2)).tolist(),
                                  2.0 if r == 0 else 0.0]
        assert res["broadcast"] == [a[1].tolist(), [0, 2, 4], True]
    # broadcast_master_param: replica 0's parameters and buffers on every replica.
    assert results[0]["own_param"] != results[1]["own_param"]
    assert results[1]["master_param"] == [results[0]["own_param"], [0.0, 0.0]]
    assert results[0]["master_param"] == results[1]["master_param"]


def test_optimizer_step_averages_gradients(api):
    _, results = api
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    grads = []
    for r in (1, 2):
        model.zero_grad()
        model((torch.arange(12, dtype=torch.float32).reshape(4, 3) * r)).square().mean().backward()
        grads.append(model.weight.grad.clone())
    average = (grads[0] + grads[1]) * 0.5
    weight = model.weight.detach() - 0.1 * average
    for r, res in results.items():
        torch.testing.assert_close(torch.tensor(res["grad_before"]), grads[r])
        torch.testing.assert_close(torch.tensor(res["grad_after"]), average)
        torch.testing.assert_close(torch.tensor(res["weight"]), weight)
    assert results[0]["weight"] == results[1]["weight"]  # bit for bit
    for res in results.values():  # inside torch_xla.compile(full_graph=True)
        assert res["compiled_weight"] == res["weight"]


def test_loader_closures_save_rng(api):
    out, results = api
    for r, res in results.items():
        # each batch's closure runs at the sync before the next batch (and at the end)
        assert res["closures"] == [[0, [0.0, 0.0]], [1, [2.0, 2.0]], [2, [4.0, 4.0]]]
        assert res["loader_len"] == 3
        assert res["rng"][0] == 77 + r
    assert results[0]["rng"][1] != results[1]["rng"][1]
    saved = torch.load(out / "saved.pt", weights_only=True)  # replica 0's, plain CPU tensors
    assert saved["step"] == 1 and saved["w"].device.type == "cpu"
    assert saved["nested"][0].tolist() == [1.0, 1.0]
    assert saved["w"].tolist() == results[0]["weight"]


def test_names_without_meaning_in_a_replica(api):
    _, results = api
    errors = results[1]["errors"]
    assert errors["use_spmd"].startswith("RuntimeError: xr.use_spmd() in a process started by "
                                         "xmp.spawn")
    assert "nprocs=1 or xr.use_spmd()" in errors["fsdp"]
    assert errors["spawn"].startswith("RuntimeError: xmp.spawn was called inside a process")
    assert "one logical device per process" in errors["device_1"]
    assert errors["groups"].startswith("NotImplementedError: xm.all_reduce(groups=[[0], [1]])")
    assert errors["group_order"].startswith(
        "NotImplementedError: xm.all_gather(groups=[[1, 0]]): the group lists the replicas out "
        "of ordinal order")
    assert errors["number"].startswith("TypeError: xm.all_reduce needs an xshard tensor or a "
                                       "list of them, got float 5.0")
    assert errors["full_graph"].startswith("RuntimeError: torch_xla.compile(<lambda>, "
                                           "full_graph=True): reading a tensor's value")


def _fail(mode: str):
    run = _compat("replica_fail.py", mode, timeout=120)
    assert run.returncode == 3, run.explain()  # the script's SpawnError handler
    assert "survived" not in run.stdout, run.explain()
    assert run.seconds < 90, run.explain()
    return run


def test_a_failing_replica_ends_the_run():
    run = _fail("raise")
    assert "SPAWN ERROR rank=1 code=1" in run.stdout, run.explain()
    assert "ValueError: replica 1 fails on purpose" in run.stderr
    # replica 0 waited in the gradient all-reduce: it says why it stops
    assert "process 0 stops at check #1 (xm.all_reduce of 'sum' over 1 tensor" in run.stderr
    assert "process 1 failed: ValueError: replica 1 fails on purpose" in run.stderr


def test_different_collectives_raise():
    run = _fail("shapes")
    assert "MultiProcessDivergenceError: the processes are about to run different device " \
           "programs" in run.stderr, run.explain()
    assert "process 0 has xm.all_reduce: 'sum' over 1 tensor (4 float32 elements); process 1 " \
           "has xm.all_reduce: 'sum' over 1 tensor (5 float32 elements)" in run.stderr


@pytest.mark.slow
def test_a_replica_that_skips_a_collective():
    run = _fail("skip")
    assert "process 1 exited" in run.stderr and "MultiProcessTimeoutError" in run.stderr


def test_a_rendezvous_a_replica_never_reaches():
    """The master alone calls xm.save, which meets the other replicas, and the other returns: an
    error naming both within seconds (gloo's all-gather waited until JAX's coordination service
    aborted the process, a minute later, with pages of 'Shutdown barrier has failed')."""
    run = _fail("save")
    assert "process 0 stops at check #1 (rendezvous of 'torch_xla.core.xla_model.save' at " \
           "replica_fail.py" in run.stderr, run.explain()
    assert "process 1 exited" in run.stderr


@pytest.mark.slow
def test_rendezvous_tags_must_agree():
    run = _fail("tags")
    assert "RendezvousMismatchError: the replicas met at rendezvous with different tags " \
           "(process 0: 'tag 0'; process 1: 'tag 1')" in run.stderr, run.explain()



def test_one_replica_per_cpu_device_when_no_platform_is_named():
    """nprocs=None: one process per local device; on CPU with PJRT_DEVICE unset, the count is
    XSHARD_CPU_DEVICES (the device-counting process has one device, like the replicas)."""
    code = ("from xshard.compat import xla_multiprocessing as m; from xshard.core import runtime; "
            "print('RESULT', m._nprocs(None), runtime.devices.cache_info().currsize)")
    env = clean_env({"XSHARD_CPU_DEVICES": "3"})
    env.pop("PJRT_DEVICE", None)
    run = run_command([sys.executable, "-c", code], env=env, timeout=120)
    assert run.returncode == 0, run.explain()
    assert "RESULT (3, 'cpu') 0" in run.stdout, run.explain()
