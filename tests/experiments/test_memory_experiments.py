"""xshard.memory (per-device accounting of a step) and the memory-scaling command, on tiny models."""

import csv
import gc
import json
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import xshard
import xshard.spmd as xs
from xshard import memory
from xshard.experiments import memory as cmd
from xshard.experiments.memory import config, search
from xshard.fsdp import FSDP
from xshard.mesh import Mesh


def _mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))


def _fsdp_step(n_devices, batch=16):
    """A compile-only FSDP training step over the first ``n_devices``; returns (model, opt, x)."""
    mesh = Mesh(list(range(n_devices)), (n_devices,), ("fsdp",))
    with torch.device("meta"):
        model = _mlp()
    model = FSDP(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.empty(batch, 32, device="meta").to(xshard.device())
    xs.mark_sharding(x, mesh, ("fsdp", None))

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    step()
    memory.abstract_sync()
    step()
    return model, opt, x


def _shard_bytes(t):
    annotation = t._cell.sharding
    shape = annotation.shard_shape(t.shape) if annotation is not None else tuple(t.shape)
    return math.prod(shape) * t.element_size()


def test_accounting_is_exact():
    with xshard.compile_only():
        model, opt, x = _fsdp_step(8)
        m = memory.analyze_step(model.parameters(), opt, [x])
        expected = sum(_shard_bytes(p) for p in model.parameters())
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
                 and v.device.type != "cpu"]
        assert m.parameter_bytes == expected
        assert m.gradient_bytes == expected          # gradients are sharded like the parameters
        assert m.optimizer_bytes == sum(_shard_bytes(v) for v in state) == 2 * expected
        assert m.input_bytes == 16 * 32 * 4 // 8
        assert m.other_argument_bytes >= 0
        assert m.argument_bytes == (m.parameter_bytes + m.optimizer_bytes + m.input_bytes
                                    + m.other_argument_bytes)
        assert m.peak_bytes == m.argument_bytes + m.output_bytes + m.temp_bytes - m.alias_bytes
        assert m.state_bytes == 4 * expected
        assert m.n_devices == 8 and m.flops > 0
    del model, opt, x
    gc.collect()


def test_fsdp_argument_bytes_fall_as_one_over_n():
    figures = {}
    with xshard.compile_only():
        for n in (1, 2, 4, 8):
            model, opt, x = _fsdp_step(n)
            figures[n] = memory.analyze_step(model.parameters(), opt, [x])
            del model, opt, x
            gc.collect()
    one = figures[1]
    for n, m in figures.items():
        assert m.parameter_bytes * n == one.parameter_bytes
        assert m.optimizer_bytes * n == one.optimizer_bytes
        assert m.input_bytes * n == one.input_bytes
        # the remaining arguments are a few replicated scalars (learning rate, betas, ...)
        assert m.argument_bytes - m.other_argument_bytes == (
            one.argument_bytes - one.other_argument_bytes) // n
        assert m.other_argument_bytes == one.other_argument_bytes


def test_analyze_without_pending_work_says_what_to_do():
    xshard.sync()
    with pytest.raises(memory.NoPendingStepError, match="trace a training step"):
        memory.analyze_step()


def test_measured_step_live_bytes_and_utilization():
    gc.collect()
    before = memory.live_bytes_per_device()  # what earlier tests left alive
    torch.manual_seed(0)
    mesh = Mesh(list(range(8)), (8,), ("data",))
    model = _mlp().to(xshard.device())
    for p in model.parameters():
        xs.mark_sharding(p, mesh, (None,) * p.dim())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 32).to(xshard.device())
    xs.mark_sharding(x, mesh, ("data", None))

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    r = memory.measure_step(step, n=2, warmup=1, peak_flops_per_device=1e12)
    assert r.seconds > 0 and r.flops > 0 and r.n_devices == 8
    assert r.utilization == pytest.approx(r.flops * 8 / (r.seconds * 1e12 * 8))
    # replicated parameters: every device holds all of them, their grads and its batch shard (the
    # warm-up step's gradients, which zero_grad dropped, no longer)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert r.live_bytes == {d: before.get(d, 0) + 2 * params + 2 * 32 * 4 for d in range(8)}
    assert r.live_bytes == memory.live_bytes_per_device()

    # A step that reads a result (it syncs itself), and the same step compiled: the same program.
    def reading():
        step()
        return model[0].weight.sum().item()

    @xshard.compile
    def compiled():
        step()
        return model[0].weight.sum()

    for other in (reading, compiled):
        o = memory.measure_step(other, n=1, warmup=2)
        assert o.n_devices == 8 and o.flops == pytest.approx(r.flops, rel=0.1), other
        assert o.live_bytes == r.live_bytes
    with pytest.raises(ValueError, match="ran nothing on the devices"):
        memory.measure_step(lambda: None)
    assert memory.utilization(2e12, 1.0, 1e12, 4) == 0.5
    with pytest.raises(ValueError, match="seconds must be positive"):
        memory.utilization(1.0, 0.0, 1e12)


@pytest.mark.parametrize("boundary", [1, 2, 3, 7, 8, 9, 40, 100])
def test_largest_fitting_returns_the_boundary(boundary):
    calls = []

    def peak_of(k):
        calls.append(k)
        return 1000 + 100 * k + (k * k) // 3  # grows, slightly faster than linearly

    budget = peak_of(boundary)
    k, probes = search.largest_fitting(peak_of, 100, budget)
    assert k == boundary
    assert probes[k] <= budget
    assert k == 100 or probes[k + 1] > budget
    assert len(set(calls)) <= 12


def test_largest_fitting_nothing_fits():
    k, probes = search.largest_fitting(lambda k: 10 * k, 50, 5)
    assert k is None and probes == {1: 10}


TINY = ["--model", "gpt-tiny", "--layers", "1", "--width", "32", "--heads", "2", "--vocab", "64",
        "--seq", "8", "--strategy", "fsdp-transformer", "--devices", "2"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("memory")


def _args(workdir, *extra):
    return [*TINY, "--out", str(workdir / "out"), "--cache-dir", str(workdir / "cache"), *extra]


def test_batch_search_fits_at_b_and_not_at_b_plus_step(workdir, capsys):
    parsed = cmd.parser().parse_args(_args(workdir))
    parsed.min_params = int(parsed.min_params)
    base = config.make_config(parsed, "gpt-tiny", "fsdp-transformer", 2, 6)
    runner = search.Runner(workdir / "cache" / "memory-results.json", extrapolate=False,
                        log=lambda s: None)
    budget = runner.evaluate(base)["peak_bytes"]      # exactly the peak at B=6 (step 2)
    assert cmd.main(_args(workdir, "--budget", str(budget), "--name", "batch")) == 0
    rows = list(csv.DictReader((workdir / "out" / "batch.csv").open()))
    assert len(rows) == 1
    row = rows[0]
    assert int(row["max_batch"]) == 6 and int(row["step"]) == 2
    assert int(row["peak_at_max"]) <= budget < int(row["peak_above"])
    probes = {int(k): v for k, v in json.loads(row["probes"]).items()}
    assert probes[6] <= budget < probes[8]
    assert (workdir / "out" / "batch.png").stat().st_size > 0


def test_batch_search_says_when_it_stopped_at_max_batch(workdir, capsys):
    """Everything up to --max-batch fits: the row says so rather than calling it the largest."""
    args = _args(workdir, "--budget", "1GiB", "--max-batch", "9", "--batch-per-device", "2",
                 "--name", "limit")
    assert cmd.main(args) == 0
    row, = csv.DictReader((workdir / "out" / "limit.csv").open())
    assert int(row["step"]) == 4 and int(row["max_batch"]) == 8 and row["at_limit"] == "True"
    assert ">= 8 (--max-batch)" in capsys.readouterr().out


def test_command_writes_table_csv_and_plot_and_caches(workdir, capsys):
    assert cmd.main(_args(workdir, "--batch", "2", "4", "--name", "sweep")) == 0
    out = capsys.readouterr().out
    assert "per-device memory" in out and "fsdp-transformer" in out
    rows = list(csv.DictReader((workdir / "out" / "sweep.csv").open()))
    assert [int(r["batch"]) for r in rows] == [2, 4]
    assert all(r["estimate"] == "compiled" and int(r["parameter_bytes"]) > 0 for r in rows)
    png = (workdir / "out" / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| model | strategy |" in (workdir / "out" / "sweep.txt").read_text()
    # a re-run computes nothing new
    assert cmd.main(_args(workdir, "--batch", "2", "4", "--name", "sweep")) == 0
    assert "0 configurations computed, 2 from the cache" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--model", "gpt-huge"], "unknown model 'gpt-huge'; choose from"),
    (["--strategy", "zero3"], "unknown strategy 'zero3'; choose from"),
    (["--devices", "16"], "XSHARD_CPU_DEVICES=8 allows 8"),
    (["--budget", "1KiB"], "nothing fits in"),
    (["--budget", "1GiB", "--max-batch", "3", "--batch-per-device", "2"],
     "--max-batch 3 is below the batch step of"),
])
def test_bad_input_is_one_line_and_exit_code_2(workdir, capsys, extra, message):
    args = _args(workdir)
    for flag in ("--model", "--strategy", "--devices"):
        if flag in extra:  # replace the default value of that flag
            i = args.index(flag)
            del args[i:i + 2]
    assert cmd.main(args + extra) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_non_positive_device_count_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        cmd.main(["--devices", "0"])
    assert e.value.code == 2
    assert "expected a positive integer, got '0'" in capsys.readouterr().err


def test_parse_and_format_bytes():
    assert memory.parse_bytes("16GiB") == 16 * 2**30
    assert memory.parse_bytes("1.5GB") == 1_500_000_000
    assert memory.format_bytes(3 * 2**30) == "3.00 GiB"
    with pytest.raises(ValueError, match="write e.g. 16GiB"):
        memory.parse_bytes("lots")
    assert np.isclose(memory.parse_bytes("512MiB"), 2**29)
