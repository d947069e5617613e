"""The same script on 2 processes x 4 CPU devices (loopback), through the launcher.

Each test launches one script (tests/multihost/scripts) whose processes print one ``RESULT`` line
each; the 1 process x 8 devices oracle runs in this (8-device) test process.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time

import pytest
import torch

from tests.multihost.conftest import SCRIPTS, clean_env, launch, run_command

pytestmark = pytest.mark.multihost


def test_basics_positions_uploads_reads_shards_collectives(tmp_path):
    run = launch("basics.py", str(tmp_path))
    assert run.returncode == 0, run.explain()
    results = run.results()
    assert sorted(results) == [0, 1], run.explain()
    for rank, r in results.items():
        assert (r["rank"], r["world"], r["local_device_count"], r["is_main"]) == \
            (rank, 2, 4, rank == 0)
        sampler = [0, 2, 4, 6] if rank == 0 else [1, 3, 5, 7]
        assert r["torch_dist"] == [rank, 2, sampler]  # DistributedSampler() with no arguments
        assert r["jax_ids"] == [0, 1, 2, 3, 2048, 2049, 2050, 2051]  # JAX's ids are not positions
        positions = list(range(4 * rank, 4 * rank + 4))
        assert r["local_positions"] == positions
        assert r["spec"] == r["y_spec"] == "{devices=[8,1]0,1,2,3,4,5,6,7}"
        assert r["replicated_sum"] == 992.0
        assert r["read_ok"] and r["gram_ok"] and r["print"].startswith("tensor([[ 1.,  4.,")
        assert r["unordered_mesh_reads"] == [[0, 1, 4, 5, 2, 3, 6, 7], True, True]
        assert r["shards"] == [[f"CPU:{p}", p, p + 1] for p in positions]
        assert r["load_local_ok"] and r["manual_ok"] and r["rng_agree"] and r["submesh_ok"]
        assert r["memory_keys"] == positions
        assert r["xm_save_ok"] and r["rendezvous_ok"]


def test_equivalence_with_one_process_fsdp_and_2d(tmp_path):
    path = tmp_path / "two.pt"
    run = launch("equivalence.py", str(path), timeout=240)
    assert run.returncode == 0, run.explain()
    results = run.results()
    assert results[0]["losses"] == results[1]["losses"]  # a replicated loss reads alike
    assert results[0]["specs"] == {"fsdp": "{devices=[8,1]0,1,2,3,4,5,6,7}",
                                   "2d": "{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}",
                                   "fsdp-compiled": "{devices=[8,1]0,1,2,3,4,5,6,7}"}
    two = torch.load(path)
    sys.path.insert(0, str(SCRIPTS))
    try:
        import equivalence
        one = equivalence.main()
    finally:
        sys.path.remove(str(SCRIPTS))
    for variant in equivalence.VARIANTS:
        assert len(two[variant]["losses"]) == equivalence.STEPS
        for a, b in zip(two[variant]["losses"], one[variant]["losses"]):
            assert math.isclose(a, b, rel_tol=1e-5), (variant, two[variant]["losses"],
                                                      one[variant]["losses"])
        assert two[variant]["params"].keys() == one[variant]["params"].keys()
        for name, value in two[variant]["params"].items():
            torch.testing.assert_close(value, one[variant]["params"][name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{variant} {name}: {m}")


def test_state_dicts():
    run = launch("state_dicts.py")
    assert run.returncode == 0, run.explain()
    results = run.results()
    for rank, r in results.items():
        assert r["full_matches_cpu"] and r["reload_matches"] and r["synced_matches_process0"]
        assert r["rank0_only_keys"] == (17 if rank == 0 else 0)
        assert r["rank0_only_matches"] is (True if rank == 0 else None)
        assert r["sharded_entry"] == ["ShardedEntry", rank, False, 256, 512]
        assert r["incomplete"] == 17
        assert "entry 'wte.weight': this entry holds 4 blocks covering 256 of 512" in \
            r["to_full_error"]


def test_divergence_is_an_error_on_every_process():
    timeout = 8
    run = launch("divergence.py", env={"XSHARD_SYNC_TIMEOUT": str(timeout)})
    assert run.returncode == 0, run.explain()
    results = {rank: r["results"] for rank, r in run.results().items()}
    for rank in (0, 1):
        r = results[rank]
        assert r["garbage_on_one_process"]["error"] is None  # collected, retried, agreed
        assert r["seeded_alike_fsdp"]["error"] is None

        shapes = r["shapes_differ"]
        assert shapes["error"] == "MultiProcessDivergenceError"
        assert "different device programs" in shapes["message"]
        assert "process 0 has aten.ones.default (8, 4) float32; process 1 has " \
               "aten.ones.default (16, 4) float32" in shapes["message"]

        read = r["rank0_only_read"]
        assert read["error"] == "MultiProcessDivergenceError"
        assert "process 0: sync at divergence.py:67 `print(\"loss\", loss.item())`" in \
            read["message"]
        assert "process 1: sync at divergence.py:69 `xshard.sync()`" in read["message"]

        upload = r["unseeded_upload"]
        assert upload["error"] == "MultiProcessDivergenceError"
        assert "values they copied to the devices since the previous check differ" in \
            upload["message"]
        assert "a (4, 4) float32 tensor at divergence.py:73 `layer = nn.Linear(4, 4).to(dev)`" \
            in upload["message"]

        fsdp = r["unseeded_fsdp"]
        assert fsdp["error"] == "ParametersDifferError"
        assert "6 of 16 parameters and buffers differ" in fsdp["message"]
        assert "sync_module_states=True" in fsdp["message"]

        seeds = r["seeded_per_rank"]
        assert seeds["error"] == "MultiProcessDivergenceError"
        assert "The device random seeds differ (process 0: 0; process 1: 1)" in seeds["message"]
        number = r["number_per_rank"]  # its message failed to build (TypeError)
        assert number["error"] == "MultiProcessDivergenceError"
        assert "Scalar input 0 of the program differs (process 0: 1.0; process 1: 2.0)" in \
            number["message"]
        for case in ("shapes_differ", "rank0_only_read", "unseeded_upload", "unseeded_fsdp",
                     "seeded_per_rank", "number_per_rank"):
            assert r[case]["seconds"] < 5, (case, r[case])
    skipped = results[0]["skipped_sync"]
    assert skipped["error"] == "MultiProcessTimeoutError"
    assert f"process 0 waited {timeout} s at check #13" in skipped["message"]
    assert "for process 1, which did not arrive; last seen: process 1 at check #12 (sync at " \
           "divergence.py:102 `xshard.sync()`)" in skipped["message"]
    assert timeout <= skipped["seconds"] < timeout + 3
    exited = results[0]["peer_exited"]
    assert exited["error"] == "MultiProcessTimeoutError"
    assert "process 1 exited" in exited["message"]
    assert exited["seconds"] < timeout


@pytest.mark.parametrize("mode, code", [("raise", 1), ("exit", 3)])
def test_fail_fast(mode, code):
    # 'exit' publishes nothing: process 0 waits at its sync until the launcher ends it (--grace).
    run = launch("failfast.py", mode, options=("--grace", "2"))
    assert run.returncode == code, run.explain()
    assert f"xshard.launch: rank 1 failed first, with exit code {code}" in run.stderr
    if mode == "raise":
        assert "ValueError: boom on process 1" in run.stderr
        assert "process 1 failed: ValueError: boom on process 1" in run.stderr  # quoted by 0
    failed_at = float(next(line.split()[-1] for line in run.stdout.splitlines()
                           if "FAILING_AT" in line))
    assert time.time() - failed_at < 10, run.explain()


def test_initialize_is_a_no_op_in_one_process():
    code = ("import xshard; xshard.initialize(); xshard.initialize(); "
            "print(xshard.process_count(), xshard.device_count(), xshard.is_main_process())")
    run = run_command([sys.executable, "-c", code], env=clean_env({"XSHARD_CPU_DEVICES": "8"}),
                      timeout=60)
    assert run.returncode == 0, run.explain()
    assert run.stdout.split() == ["1", "8", "True"]


def test_initialize_names_the_missing_processes():
    code = "import xshard; xshard.initialize()"
    env = clean_env({"XSHARD_COORDINATOR_ADDRESS": "127.0.0.1:1", "XSHARD_NUM_PROCESSES": "3",
                     "XSHARD_PROCESS_ID": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(_free_port()), "XSHARD_INIT_TIMEOUT": "2"})
    run = run_command([sys.executable, "-c", code], env=env, timeout=60)
    assert run.returncode == 1, run.explain()
    assert "InitializationError: xshard.initialize(): 1 of 3 processes joined within 2 s " \
           "(rendezvous at 127.0.0.1:" in run.stderr, run.explain()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_initialize_from_torchrun_variables():
    import subprocess

    port = _free_port()
    procs = []
    start = time.monotonic()
    try:
        for rank in range(2):
            env = clean_env({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                             "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(port), "XSHARD_CPU_DEVICES": "4"})
            procs.append(subprocess.Popen([sys.executable, "torchrun_env.py"], cwd=SCRIPTS,
                                          env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err[-4000:]
        result = json.loads(out.split("RESULT ", 1)[1])
        assert result == {"rank": rank, "world": 2, "total": 240.0, "devices": 8}
    assert time.monotonic() - start < 90
