"""The SPMD examples run and match eager CPU PyTorch (each takes 30-45 s: marked slow)."""

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["spmd_2d.py", "spatial_partitioning.py"])
def test_example_runs(name):
    env = dict(os.environ, XSHARD_CPU_DEVICES="8", PJRT_DEVICE="CPU")
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK:" in proc.stdout
