"""The compiled-step benchmark's sides compute the same thing (tiny sizes; speed is never
asserted)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_compile  # noqa: E402


def test_compiled_step_matches_jax_in_every_layout():
    args = bench_compile.parse_args(["--model", "tiny", "--steps", "1", "--rounds", "1",
                                     "--warmup", "3", "--lazy"])
    results = bench_compile.main(args)
    assert [r["mode"] for r in results] == ["fsdp", "fsdp-free", "fsdp-keep", "2d"]
    for r in results:
        assert r["max_loss_diff"] < 1e-5, r
        assert r["recordings"] == 2  # the first step creates AdamW's state
        assert r["timed_recompiles"] == 0
        assert set(r["runners"]) == {"xshard.compile", "JAX", "xshard lazy"}
