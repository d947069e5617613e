"""The step benchmark's two sides compute the same thing (tiny sizes; speed is never asserted)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_step  # noqa: E402

TINY_GPT = ["--model", "gpt", "--gpt-layers", "2", "--gpt-embd", "64", "--gpt-heads", "4",
            "--gpt-vocab", "256", "--gpt-block", "16", "--steps", "1", "--rounds", "1"]


def test_fsdp_matches_both_jax_baselines_step_by_step():
    results = bench_step.main(bench_step.parse_args(TINY_GPT + ["--devices", "8", "--fsdp"]))
    assert [r["baseline"] for r in results] == ["JAX FSDP", "JAX, free layout"]
    for r in results:
        assert r["max_loss_diff"] < 1e-5, r
        assert r["recompiles"] == 0
        assert all(b > 0 for b in r["temp_bytes"])  # both sides' compiled memory was read


def test_fsdp_and_shard_batch_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--devices", "8", "--fsdp", "--shard-batch"])
    assert "not both" in capsys.readouterr().err
