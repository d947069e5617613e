"""The Kaggle-style script (scripts/mp_cnn.py) run unchanged through ``python -m xshard.compat``,
against an eager CPU simulation of the same replicas (tests/compat/oracle.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from tests.compat import oracle
from tests.multihost.conftest import clean_env, run_command

pytestmark = pytest.mark.multihost

# float32 through a few SGD steps: the lowered convolutions and reductions round differently
RTOL, ATOL = 1e-4, 1e-5


def _run_script(out, num_cores: int, env: dict | None = None):
    argv = [sys.executable, "-m", "xshard.compat", "mp_cnn.py", "--num_cores", str(num_cores),
            "--out", str(out)]
    run = run_command(argv, env=clean_env(env), timeout=240, cwd=oracle.SCRIPTS)
    assert run.returncode == 0, run.explain()
    return run


def _flags(num_cores: int):
    return oracle.load_script().parse_flags(["--num_cores", str(num_cores)])


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("two")
    run = _run_script(out, 2)
    return out, run, oracle.simulate(_flags(2), 2)


def _assert_state(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, value in want.items():
        assert got[name].device.type == "cpu" and got[name].dtype == value.dtype, (what, name)
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what} {name}: {m}")


def test_two_replicas_equal_the_cpu_replicas(two):
    out, run, sim = two
    results = run.results()
    assert sorted(results) == [0, 1], run.explain()
    for r in (0, 1):
        res = results[r]
        assert (res["index"], res["world"], res["ordinal"], res["master"]) == (r, 2, r, r == 0)
        assert res["lengths"] == [4, 4]  # 32 samples / 2 replicas / batch 4, per epoch
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(sim["losses"][r]),
                                   rtol=RTOL, atol=ATOL)
        assert res["accuracy"] == sim["accuracies"][r]
        assert res["accuracy_mean"] == sim["accuracy_mean"]  # mesh_reduce(np.mean)
        _assert_state(torch.load(out / f"replica{r}.pt"), sim["states"][r], f"replica {r}")
    # Per-replica data, dropout and BatchNorm statistics; averaged gradients keep the parameters
    # identical across replicas while the BatchNorm buffers stay each replica's own.
    assert results[0]["losses"] != results[1]["losses"]
    states = [torch.load(out / f"replica{r}.pt") for r in (0, 1)]
    for name, value in states[0].items():
        if "running" in name:
            assert not torch.allclose(value, states[1][name]), name
        elif "num_batches" not in name:
            assert torch.equal(value, states[1][name]), name
    # master_print: once, from replica 0.
    printed = re.findall(r"^\[(\d)\] Finished training epoch (\d)$", run.stdout, re.M)
    assert printed == [("0", "1"), ("0", "2")], run.stdout
    assert re.findall(r"^\[(\d)\] Accuracy: ", run.stdout, re.M) == ["0"]
    # torch_xla.debug.metrics and .profiler work inside the replicas: the metrics report comes
    # from replica 0, each replica compiled its steps (a steady step reuses its executables).
    assert re.search(r"^\[0\] Metric: CompileTime", run.stdout, re.M), run.stdout
    for res in results.values():
        assert "CompileTime" in res["metrics"] and "ExecuteTime" in res["metrics"]
        assert 0 < res["compiles"] < 20


def test_xm_save_loads_without_xshard(two):
    out, _, sim = two
    code = (
        "import sys, json, torch\n"
        "sys.modules['xshard'] = None\n"
        "sys.modules['torch_xla'] = None\n"
        "state = torch.load(sys.argv[1], weights_only=True)\n"
        "print(json.dumps({k: [v.device.type, str(v.dtype), v.double().sum().item()]\n"
        "                  for k, v in state.items()}))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(out / "model.pt")], timeout=120,
                          capture_output=True, text=True, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    want = sim["states"][0]  # written once, by replica 0
    assert loaded.keys() == want.keys()
    for name, (device, dtype, total) in loaded.items():
        assert device == "cpu" and dtype == str(want[name].dtype), name
        assert total == pytest.approx(want[name].double().sum().item(), rel=RTOL, abs=1e-4), name
    _assert_state(torch.load(out / "model.pt"), want, "model.pt")


def test_one_process_equals_the_cpu_model(tmp_path):
    run = _run_script(tmp_path, 1)
    sim = oracle.simulate(_flags(1), 1)
    (line,) = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
    res = json.loads(line[len("RESULT "):])
    assert (res["index"], res["world"], res["ordinal"], res["master"]) == (0, 1, 0, True)
    assert res["lengths"] == [8, 8]
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(sim["losses"][0]),
                               rtol=RTOL, atol=ATOL)
    assert res["accuracy"] == res["accuracy_mean"] == sim["accuracies"][0]
    _assert_state(torch.load(tmp_path / "model.pt"), sim["states"][0], "model.pt")
    assert run.stdout.count("Finished training epoch") == 2


_SETS_ITS_ENVIRONMENT = '''
import os
os.environ["PJRT_DEVICE"] = "CPU"
os.environ["XSHARD_CPU_DEVICES"] = "4"
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
import xshard
x = torch.arange(8.0, device=xm.xla_device())
print("RESULT", xr.global_runtime_device_count(), xshard.device_count(), x.sum().item())
'''


def test_a_script_may_set_the_platform_at_its_top(tmp_path):
    """``python -m xshard.compat`` imports xshard before the script's first line: the platform and
    device count the script sets there are still the ones used (torch_xla reads them at first
    use); set after JAX has started, they raise rather than be ignored."""
    script = tmp_path / "sets_env.py"
    script.write_text(_SETS_ITS_ENVIRONMENT)
    run = run_command([sys.executable, "-m", "xshard.compat", str(script)], env=clean_env(),
                      timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.explain()
    assert "RESULT 4 4 28.0" in run.stdout, run.explain()
    late = tmp_path / "late_env.py"
    late.write_text("import jax\njax.devices()\n" + _SETS_ITS_ENVIRONMENT)
    run = run_command([sys.executable, "-m", "xshard.compat", str(late)], env=clean_env(),
                      timeout=120, cwd=tmp_path)
    assert run.returncode != 0
    assert re.search(r"RuntimeConfigError: The environment asks for PJRT_DEVICE='CPU', "
                     r"XSHARD_CPU_DEVICES='4', but JAX started its backends before it was set "
                     r"and runs 1 cpu device", run.stderr), run.explain()


def test_torch_xla_environment_variables(tmp_path):
    """CPU_NUM_DEVICES (torch_xla's name for XSHARD_CPU_DEVICES) and XLA_USE_SPMD=1 (its older
    xr.use_spmd()) are honoured; XLA_USE_BF16, which xshard does not apply, warns."""
    script = tmp_path / "env.py"
    script.write_text("import torch_xla.runtime as xr\nimport xshard\n"
                      "print('RESULT', xshard.device_count(), xr.is_spmd())\n")
    env = clean_env({"CPU_NUM_DEVICES": "3", "XLA_USE_SPMD": "1", "XLA_USE_BF16": "1"})
    run = run_command([sys.executable, "-m", "xshard.compat", str(script)], env=env,
                      timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.explain()
    assert "RESULT 3 True" in run.stdout, run.explain()
    assert "XLA_USE_BF16='1' is ignored by xshard.compat" in run.stderr, run.explain()
