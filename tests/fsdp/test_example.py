"""The README's FSDP demo runs and matches eager CPU (about 30-40 s: marked slow)."""

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_gpt_fsdp.py"


@pytest.mark.slow
def test_train_gpt_fsdp_example_runs():
    env = dict(os.environ, XSHARD_CPU_DEVICES="8", PJRT_DEVICE="CPU")
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "3", "--check"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "OK:" in out and "step   2" in out
    assert "{devices=[8,1]0,1,2,3,4,5,6,7}" in out  # a parameter's sharding
    assert "temporaries" in out and "live buffers" in out


@pytest.mark.slow
def test_train_gpt_fsdp_example_accumulates_under_no_sync():
    env = dict(os.environ, XSHARD_CPU_DEVICES="8", PJRT_DEVICE="CPU")
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "2", "--batch", "16",
                           "--accumulate", "2", "--check"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK:" in proc.stdout


def test_train_gpt_fsdp_example_rejects_an_accumulation_not_dividing_the_batch():
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--batch", "8", "--accumulate", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--accumulate 3 must be a positive divisor of --batch 8" in proc.stderr
