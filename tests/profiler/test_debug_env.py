"""XSHARD_DEBUG=1 (read once at start-up): every graph run says whether it compiled, why, and which
user line triggered it. Run in subprocesses, since the setting is read when xshard is imported."""

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import warnings
    import torch, xshard
    warnings.simplefilter("ignore")
    dev = xshard.device()
    w = torch.randn(8, 8).to(dev)

    def train_step(n):
        x = torch.randn(n, 8).to(dev)
        y = (x @ w).relu().sum()
        xshard.sync()
        return y

    for n in (4, 4, 6):
        train_step(n)
    print("value", train_step(6).item())
""")


def _run(debug):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), XSHARD_CPU_DEVICES="1")
    env.pop("XSHARD_DEBUG", None)
    if debug is not None:
        env["XSHARD_DEBUG"] = debug
    return subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)


def test_debug_reports_each_graph_run():
    out = _run("1")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("xshard-debug: ")]
    assert len(lines) == 4, out.stderr
    first, second, third, fourth = lines
    assert "graph 1: COMPILED xshard_train_step_1 (3 ops, 2 inputs)" in first
    assert "cause: no graph was cached yet" in first
    assert "for <string>:11 in train_step" in first
    assert "graph 2: cached xshard_train_step_1 (3 ops)" in second
    assert "graph 3: COMPILED xshard_train_step_2" in third
    assert "cause: input 0 shape: ((4, 8), torch.float32) -> ((6, 8), torch.float32)" in third
    assert "graph 4: cached xshard_train_step_2" in fourth
    assert "value" in out.stdout


def test_debug_off_prints_nothing():
    out = _run(None)  # unset: off ("0" is accepted too)
    assert out.returncode == 0, out.stderr
    assert "xshard-debug" not in out.stderr and "value" in out.stdout


def test_debug_bad_value_is_refused():
    out = _run("yes")
    assert out.returncode != 0
    assert "XSHARD_DEBUG='yes' must be 1" in out.stderr
