"""Running scripts as several processes through ``xshard.launch``, bounded in time.

Every launch runs in its own session and its whole process group is killed when the test ends, so
no process outlives a test. The launcher is run by file path (``python xshard/launch.py``): the
same module as ``python -m xshard.launch`` (tested in test_launch.py) without importing the xshard
package (torch, JAX) in the launcher process, which would add seconds to each launch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
LAUNCHER = ROOT / "xshard" / "launch.py"

# Small timeouts, one eigen thread per process: the machine has few cores.
ENV = {
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
    "XSHARD_HEARTBEAT_TIMEOUT": "10",
    "XSHARD_SHUTDOWN_TIMEOUT": "10",
    "XSHARD_SYNC_TIMEOUT": "20",
    "XSHARD_INIT_TIMEOUT": "30",
    "PJRT_DEVICE": "CPU",
}


@dataclasses.dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def results(self) -> dict[int, dict]:
        """The ``RESULT {json}`` line of each rank, by rank."""
        out = {}
        for line in self.stdout.splitlines():
            match = re.match(r"^\[(\d+)\] RESULT (.*)$", line)
            if match:
                out[int(match.group(1))] = json.loads(match.group(2))
        return out

    def explain(self) -> str:
        return f"exit {self.returncode} after {self.seconds:.1f} s\n--- stdout\n{self.stdout}" \
               f"\n--- stderr\n{self.stderr[-6000:]}"


def clean_env(extra: dict | None = None) -> dict:
    """The test process's environment without any multi-process settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("XSHARD_") and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(ENV)
    env.update(extra or {})
    return env


def run_command(argv: list[str], *, env: dict, timeout: float, cwd=SCRIPTS) -> Run:
    """Runs ``argv`` in its own session; kills its whole process group when done or late."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{argv} did not end within {timeout} s\n{out}\n{err[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return Run(proc.returncode, out, err, time.monotonic() - start)


def launch(script: str, *args: str, nproc: int = 2, cpu_devices: int = 4, timeout: float = 120,
           env: dict | None = None, options: tuple = ()) -> Run:
    """``python -m xshard.launch --nproc N --cpu-devices K --timeout T [options] script args``."""
    argv = [sys.executable, str(LAUNCHER), "--nproc", str(nproc), "--cpu-devices",
            str(cpu_devices), "--timeout", str(timeout), *options, script, *args]
    return run_command(argv, env=clean_env(env), timeout=timeout + 15)

