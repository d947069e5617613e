"""python -m xshard.launch: arguments, environment, output, failures, timeouts (plain-Python children:
no JAX, so each run takes a fraction of a second)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from tests.multihost.conftest import LAUNCHER, ROOT, clean_env, run_command
from xshard import launch


def _script(tmp_path, body: str):
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _launch(tmp_path, *args, timeout=30):
    return run_command([sys.executable, str(LAUNCHER), *args], env=clean_env(),
                       timeout=timeout, cwd=tmp_path)


@pytest.mark.parametrize("argv, message", [
    ([], "invalid arguments"),
    (["--nproc", "0", "x.py"], "invalid arguments"),
    (["--nproc", "two", "x.py"], "invalid arguments"),
    (["--nproc", "2", "--timeout", "-1", "x.py"], "invalid arguments"),
    (["--nproc", "2"], "no script given"),
    (["--nproc", "2", "missing.py"], "script 'missing.py' does not exist"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(launch.LaunchError, match=message):
        launch.parse_args(argv)
    assert launch.main(argv) == 2
    assert message in capsys.readouterr().err


def test_module_form_reports_bad_arguments(tmp_path):
    run = run_command([sys.executable, "-m", "xshard.launch", "--nproc", "2", "missing.py"],
                      env=clean_env(), timeout=60, cwd=ROOT)
    assert run.returncode == 2
    assert "xshard.launch: script 'missing.py' does not exist" in run.stderr


def test_free_ports_are_distinct_loopback_ports():
    ports = launch.free_ports(4)
    assert len(set(ports)) == 4 and all(0 < p < 65536 for p in ports)


def test_child_environment():
    env = launch.child_environment({"PATH": "/bin"}, rank=1, nproc=3, coordinator_port=1000,
                                   master_port=1001, cpu_devices=4, hash_seed="7")
    assert env["XSHARD_COORDINATOR_ADDRESS"] == "127.0.0.1:1000"
    assert (env["XSHARD_NUM_PROCESSES"], env["XSHARD_PROCESS_ID"]) == ("3", "1")
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == \
        ("1", "3", "1", "3")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "1001")
    assert (env["XSHARD_CPU_DEVICES"], env["PJRT_DEVICE"], env["PYTHONHASHSEED"]) == \
        ("4", "CPU", "7")
    assert env["PATH"] == "/bin"


def test_output_is_prefixed_and_environment_shared(tmp_path):
    child = _script(tmp_path, """
        import os, sys
        print("rank", os.environ["RANK"], "seed", os.environ["PYTHONHASHSEED"], sys.argv[1:])
        print("to stderr", file=sys.stderr)
    """)
    run = _launch(tmp_path, "--nproc", "3", child, "--flag", "x")
    assert run.returncode == 0, run.explain()
    lines = sorted(run.stdout.splitlines())
    seeds = {line.split()[4] for line in lines}
    assert len(seeds) == 1  # one PYTHONHASHSEED for every process
    assert [line.split()[:3] for line in lines] == [["[0]", "rank", "0"], ["[1]", "rank", "1"],
                                                    ["[2]", "rank", "2"]]
    assert all(line.endswith("['--flag', 'x']") for line in lines)
    assert sorted(run.stderr.splitlines()) == [f"[{r}] to stderr" for r in range(3)]


def test_first_failure_ends_the_others_and_names_its_rank(tmp_path):
    child = _script(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(7)
        time.sleep(60)
    """)
    run = _launch(tmp_path, "--nproc", "3", "--grace", "1", child)
    assert run.returncode == 7
    assert "xshard.launch: rank 1 failed first, with exit code 7" in run.stderr
    assert run.seconds < 10


def test_timeout_exits_124(tmp_path):
    child = _script(tmp_path, "import time; time.sleep(60)\n")
    run = _launch(tmp_path, "--nproc", "2", "--timeout", "1", child)
    assert run.returncode == launch.TIMEOUT_EXIT == 124
    assert "timed out after 1 s" in run.stderr
    assert run.seconds < 10
