"""Starts the same script as N local processes of one xshard run (standard library only).

    python -m xshard.launch --nproc 2 --cpu-devices 4 [--timeout 600] train.py --lr 1e-3
    python -m xshard.launch --nproc 2 -m mypackage.train --lr 1e-3

Each process gets the variables ``xshard.initialize()`` reads (``XSHARD_COORDINATOR_ADDRESS``,
``XSHARD_NUM_PROCESSES``, ``XSHARD_PROCESS_ID``) and those ``torchrun`` sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so code
written for torchrun (``DistributedSampler()``, ``torch.distributed.checkpoint``) runs unchanged.
Both ports are free loopback ports (port 0 bound on 127.0.0.1); every process shares one
``PYTHONHASHSEED`` (yours if set). ``--cpu-devices K`` gives each process K virtual CPU devices
(``XSHARD_CPU_DEVICES``, and ``PJRT_DEVICE=CPU`` unless set).

Every line a process prints is prefixed with its rank (``[1] loss 2.31``). When a process fails,
the others get ``--grace`` seconds (default 5) to end on their own (xshard's fail-fast and the
divergence check usually end them sooner, with a better message), then SIGTERM, then SIGKILL.
The launcher exits with the first failing process's exit code and names its rank; with 124 when
``--timeout`` seconds pass first; with 2 for bad arguments.

This module imports nothing but the standard library, so it starts at once and works before
torch or JAX are importable.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import NamedTuple

TIMEOUT_EXIT = 124
_POLL_S = 0.05
_KILL_AFTER_TERM_S = 2.0


class LaunchError(ValueError):
    """The command line cannot start a run (a bad count, a missing script...)."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m xshard.launch",
        description="Run a script as N local processes of one xshard run (2 processes x 4 virtual "
                    "CPU devices: --nproc 2 --cpu-devices 4).")
    parser.add_argument("--nproc", type=_positive_int, required=True,
                        help="number of processes to start")
    parser.add_argument("--cpu-devices", type=_positive_int, default=None,
                        help="virtual CPU devices per process (sets XSHARD_CPU_DEVICES, and "
                             "PJRT_DEVICE=CPU unless set)")
    parser.add_argument("--timeout", type=_positive_float, default=None,
                        help="end every process after this many seconds and exit with 124")
    parser.add_argument("--grace", type=_positive_float, default=5.0,
                        help="seconds the others get to end after one process fails (default 5)")
    parser.add_argument("-m", dest="module", default=None,
                        help="run a module (as python -m) instead of a script file")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the script and its arguments (or, with -m, the module's arguments)")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parses and validates the launcher's arguments; raises ``LaunchError`` with the fix."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed its message already
        raise LaunchError(f"invalid arguments (see the message above); usage: "
                          f"{parser.format_usage().strip()}") from e
    if args.module is None:
        if not args.command:
            raise LaunchError("no script given: python -m xshard.launch --nproc N script.py "
                              "[args...] (or -m module [args...])")
        script = args.command[0]
        if script.startswith("-"):
            raise LaunchError(f"{script!r} is not a script; launcher options come before the "
                              f"script, e.g. python -m xshard.launch --nproc 2 train.py")
        if not os.path.isfile(script):
            raise LaunchError(f"script {script!r} does not exist (working directory "
                              f"{os.getcwd()!r}); pass a path to a Python file, or -m module.")
        args.argv = [sys.executable, *args.command]
    else:
        args.argv = [sys.executable, "-m", args.module, *args.command]
    return args


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (bound to port 0, then released)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def child_environment(base: dict, rank: int, nproc: int, coordinator_port: int,
                      master_port: int, cpu_devices: int | None, hash_seed: str) -> dict:
    """The environment of process ``rank``: xshard's and torchrun's variables over ``base``."""
    env = dict(base)
    env.update({
        "XSHARD_COORDINATOR_ADDRESS": f"127.0.0.1:{coordinator_port}",
        "XSHARD_NUM_PROCESSES": str(nproc),
        "XSHARD_PROCESS_ID": str(rank),
        "RANK": str(rank), "WORLD_SIZE": str(nproc),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
        "PYTHONHASHSEED": hash_seed,
        "PYTHONUNBUFFERED": "1",
    })
    if cpu_devices is not None:
        env["XSHARD_CPU_DEVICES"] = str(cpu_devices)
        env.setdefault("PJRT_DEVICE", "CPU")
    return env


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the launcher dies (Linux), so none outlives it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001  (best effort: other platforms rely on the launcher's kill)
        pass


def _pump(stream, out, prefix: bytes, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _say(message: str) -> None:
    sys.stderr.write(f"xshard.launch: {message}\n")
    sys.stderr.flush()


class _Run:
    """The started processes, their output pumps, and how they ended."""

    def __init__(self, args: argparse.Namespace, env: dict | None = None):
        self.args = args
        self.env = env
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.failed_rank: int | None = None

    def start(self) -> None:
        args = self.args
        coordinator_port, master_port = free_ports(2)
        hash_seed = os.environ.get("PYTHONHASHSEED") or str(random.randrange(1, 2**32))
        out, err = _binary(sys.stdout), _binary(sys.stderr)
        for rank in range(args.nproc):
            base = os.environ if self.env is None else self.env
            env = child_environment(base, rank, args.nproc, coordinator_port, master_port,
                                    args.cpu_devices, hash_seed)
            proc = subprocess.Popen(args.argv, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_parent)
            self.procs.append(proc)
            prefix = f"[{rank}] ".encode()
            for stream, sink in ((proc.stdout, out), (proc.stderr, err)):
                pump = threading.Thread(target=_pump, args=(stream, sink, prefix, self.lock),
                                        daemon=True)
                pump.start()
                self.pumps.append(pump)

    def wait(self) -> int:
        """Waits for the run; returns the launcher's exit code."""
        args = self.args
        deadline = None if args.timeout is None else time.monotonic() + args.timeout
        first = None  # (rank, exit code) of the first failure
        stop_at = None
        while True:
            codes = [p.poll() for p in self.procs]
            if first is None:
                for rank, code in enumerate(codes):
                    if code not in (None, 0):
                        first = (rank, _exit_code(code))
                        _say(f"rank {rank} failed with exit code {first[1]}; ending the other "
                             f"processes in {args.grace:g} s")
                        stop_at = time.monotonic() + args.grace
                        break
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self.stop()
                self.drain()
                _say(f"timed out after {args.timeout:g} s (--timeout); ended every process")
                return TIMEOUT_EXIT
            if stop_at is not None and now >= stop_at:
                self.stop()
                break
            time.sleep(_POLL_S)
        self.drain()
        if first is None:
            return 0
        rank, code = first
        self.failed_rank = rank
        _say(f"rank {rank} failed first, with exit code {code}")
        return code

    def stop(self) -> None:
        """SIGTERM to every process group still running, SIGKILL to those that linger."""
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
        end = time.monotonic() + _KILL_AFTER_TERM_S
        while time.monotonic() < end and any(p.poll() is None for p in live):
            time.sleep(_POLL_S)
        for p in self.procs:
            # The whole group: grandchildren die too, even when the child itself has ended.
            _signal_group(p, signal.SIGKILL)
            if p.poll() is None:
                p.wait()

    def drain(self) -> None:
        for pump in self.pumps:
            pump.join(timeout=2.0)


def _binary(stream):
    """A binary stream writing to ``stream`` (its buffer, or the stream itself when it has none)."""
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:
        return buffer

    class _Text:
        def write(self, data: bytes) -> None:
            stream.write(data.decode(errors="replace"))

        def flush(self) -> None:
            stream.flush()

    return _Text()


class LaunchResult(NamedTuple):
    """How a run started by ``run()`` ended: the launcher's exit code (0, the first failing
    process's code, or 124 on timeout) and the rank that failed first (None if none did)."""

    exit_code: int
    failed_rank: int | None


def run(argv: list[str], nproc: int, *, cpu_devices: int | None = None,
        timeout: float | None = None, grace: float = 5.0, env: dict | None = None) -> LaunchResult:
    """Runs ``argv`` as ``nproc`` processes of one run and waits for them (what ``main`` does
    after parsing its command line; ``xshard.compat``'s ``xmp.spawn`` calls it).

    Args:
        argv: the command each process runs (``[sys.executable, script, ...]``).
        nproc: how many processes.
        cpu_devices: virtual CPU devices per process (and ``PJRT_DEVICE=CPU`` unless set).
        timeout: end every process after this many seconds (exit code 124).
        grace: seconds the others get to end after one process fails.
        env: the environment the processes' variables are added to (default ``os.environ``).

    Returns:
        A ``LaunchResult``.

    Example:
        >>> run([sys.executable, "train.py"], 2, cpu_devices=4)   # doctest: +SKIP
        LaunchResult(exit_code=0, failed_rank=None)
    """
    args = argparse.Namespace(argv=list(argv), nproc=nproc, cpu_devices=cpu_devices,
                              timeout=timeout, grace=grace)
    started = _Run(args, env)

    def forward(signum, frame):
        _say(f"received signal {signum}; ending every process")
        started.stop()
        raise SystemExit(128 + signum)

    # Signal handlers can only be set from the main thread; elsewhere the children still end with
    # this process (PR_SET_PDEATHSIG).
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} \
        if main_thread else {}
    try:
        started.start()
        code = started.wait()
        return LaunchResult(code, started.failed_rank)
    finally:
        started.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    """Runs the launcher; returns its exit code (see the module docstring)."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except LaunchError as e:
        _say(str(e))
        return 2
    return run(args.argv, args.nproc, cpu_devices=args.cpu_devices, timeout=args.timeout,
               grace=args.grace).exit_code


if __name__ == "__main__":
    sys.exit(main())
