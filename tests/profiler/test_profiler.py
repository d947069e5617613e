"""xshard.profiler: a trace written on CPU holds the user's Trace/StepTrace spans, xshard's phase
spans (properly nested), and programs named after the user's function, never
``jit(<unnamed function>)``; naming never recompiles; StepTrace syncs; remote capture's client;
clear errors for misuse."""

import collections
import glob
import gzip
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import xshard
import xshard.profiler as xp
from xshard.core import api
from xshard.core import metrics as met
from xshard.core import trace as core_trace

DEV = xshard.device()

XSHARD_SPANS = {"xshard.record", "xshard.sync", "xshard.build_graph", "xshard.compile",
                "xshard.execute", "xshard.transfer_to_device", "xshard.transfer_from_device"}


def _events(run_dir):
    """(plane, line, name, start_ns, end_ns, stats) of every event in the run's xplane."""
    from jax.profiler import ProfileData

    [path] = glob.glob(os.path.join(run_dir, "*.xplane.pb"))
    data = ProfileData.from_file(path)
    return [(plane.name, line.name, ev.name, ev.start_ns, ev.start_ns + ev.duration_ns,
             dict(ev.stats))
            for plane in data.planes for line in plane.lines for ev in line.events]


def make_model():
    """A small model with shapes no other test uses, so its step compiles inside the trace."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def profiled_train_step(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    xshard.sync()  # this function triggers the sync: the program is named after it
    return loss


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """Three profiled steps of a small model: (run directory, events, loss values)."""
    model = make_model().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(5, 13) for _ in range(3)]
    logdir = tmp_path_factory.mktemp("profile")
    xp.start_trace(str(logdir), create_perfetto_trace=True)
    try:
        losses = []
        for step, x in enumerate(batches):
            with xp.StepTrace("train_step", step_num=step):
                with xp.Trace("fwd_bwd"):
                    loss = profiled_train_step(model, opt, x.to(DEV))
                    loss = loss * 1  # recorded after the sync: its span must end with fwd_bwd
            losses.append(loss.item())
    finally:
        run_dir = xp.stop_trace()
    return run_dir, _events(run_dir), losses


def test_trace_files_where_stop_trace_says(traced):
    run_dir, _, _ = traced
    parent = os.path.dirname(run_dir)
    assert os.path.basename(parent) == "profile"
    assert os.path.basename(os.path.dirname(parent)) == "plugins"
    files = os.listdir(run_dir)
    assert len([f for f in files if f.endswith(".xplane.pb")]) == 1
    assert len([f for f in files if f.endswith(".trace.json.gz")]) == 1
    assert "perfetto_trace.json.gz" in files


def test_user_spans_with_step_numbers(traced):
    _, events, _ = traced
    steps = [e for e in events if e[2] == "train_step"]
    assert sorted(int(e[5]["step_num"]) for e in steps) == [0, 1, 2]
    assert len([e for e in events if e[2] == "fwd_bwd"]) == 3
    for _, _, _, start, end, _ in [e for e in events if e[2] == "fwd_bwd"]:
        assert any(s <= start and end <= t for _, _, _, s, t, _ in steps)


def test_xshard_phases_and_named_program(traced):
    _, events, _ = traced
    names = collections.Counter(e[2] for e in events)
    assert XSHARD_SPANS <= set(names), XSHARD_SPANS - set(names)
    assert names["xshard.sync"] >= 3 and names["xshard.execute"] >= 3
    programs = {n for n in names if n.startswith("PjitFunction(jit(xshard_profiled_train_step_")}
    assert programs, sorted(n for n in names if "jit" in n)
    assert not [n for n in names if "<unnamed function>" in n or "unnamed" in n]
    # The compile of the step happened inside the trace, under the sync that the step triggered.
    [compile_span] = [e for e in events if e[2] == "xshard.compile"
                      and any(s <= e[3] and e[4] <= t for _, _, n, s, t, _ in events
                              if n == "xshard.sync")][:1]
    assert compile_span[4] > compile_span[3]


def test_spans_on_the_python_thread_nest(traced):
    """Trace viewers need spans on one thread to nest: recording spans end at every boundary."""
    _, events, _ = traced
    ours = XSHARD_SPANS | {"train_step", "fwd_bwd"}
    by_line = collections.defaultdict(list)
    for plane, line, name, start, end, _ in events:
        if name in ours:
            by_line[(plane, line)].append((start, end, name))
    # The program's thread, and PyTorch's autograd thread (backward ops are recorded there).
    assert {line for _, line in by_line} <= {"python", "pt_autograd_0"}
    for spans in by_line.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack = []
        for start, end, name in spans:
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack:
                assert end <= stack[-1][1], f"{name} [{start}, {end}] straddles {stack[-1]}"
            stack.append((start, end, name))


def test_trace_json_for_perfetto(traced):
    run_dir, _, _ = traced
    for pattern in ("*.trace.json.gz", "perfetto_trace.json.gz"):
        [path] = glob.glob(os.path.join(run_dir, pattern))
        with gzip.open(path, "rt") as f:
            doc = json.load(f)
        names = {e.get("name") for e in doc["traceEvents"]}
        assert {"train_step", "fwd_bwd", "xshard.sync", "xshard.compile"} <= names
        assert any(n and n.startswith("PjitFunction(jit(xshard_profiled_train_step_")
                   for n in names)
        assert not any(n and "<unnamed function>" in n for n in names)


def test_profiled_losses_match_eager(traced):
    _, _, losses = traced
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(5, 13) for _ in range(3)]
    expected = []
    for x in batches:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-5)


def test_names_never_change_the_cache():
    """The same graph from another function reuses the executable (and its first name)."""
    a = torch.randn(3, 17).to(DEV)
    xshard.sync()

    def first_function():
        return xshard.debug.hlo_text([(a * 5).exp()])

    def another_function():
        (a * 5).exp().cpu()
        return (a * 5).exp().cpu()

    hlo = first_function()
    assert "HloModule jit_xshard_first_function_" in hlo
    another_function()  # compiles once (hlo_text does not cache), then reuses
    before = met.snapshot()
    (a * 5).exp().cpu()
    with core_trace.naming("renamed"):
        (a * 5).exp().cpu()
    after = met.snapshot()
    assert after["compiles"] == before["compiles"]
    assert after["cache_hits"] == before["cache_hits"] + 2


def test_naming_names_programs():
    a = torch.randn(2, 19).to(DEV)
    with core_trace.naming("my step<1>"):
        hlo = xshard.debug.hlo_text([a.sin()])
    assert "HloModule jit_xshard_my_step_1_" in hlo
    assert "HloModule jit_xshard_test_naming_names_programs_" in xshard.debug.hlo_text([a.cos()])
    with pytest.raises(TypeError, match="non-empty str"):
        core_trace.naming("")


def test_step_trace_syncs_and_counts_a_mark_step():
    a = torch.randn(4, 4).to(DEV)
    xshard.sync()
    marks = met.counter_value("MarkStep") or 0
    with xp.StepTrace("step", step_num=7):
        b = a @ a
        assert not api.settled(b)
    assert api.settled(b)
    assert met.counter_value("MarkStep") == marks + 1
    assert xp.get_tracer_marked_step()
    xp.set_tracer_marked_step(False)
    with pytest.raises(ZeroDivisionError):
        with xp.StepTrace("step"):  # an error inside: no sync, the error propagates
            c = a + 1
            1 / 0
    assert not api.settled(c) and met.counter_value("MarkStep") == marks + 1
    xshard.sync()


def test_trace_me_and_spans_without_a_trace():
    @xp.trace_me("helper")
    def helper(x):
        return x * 2

    assert helper(3) == 6
    span = xp.Trace("reused", batch=4)
    with span:
        with span:  # re-entered: nests
            pass


def test_misuse_raises_clear_errors(tmp_path):
    with pytest.raises(RuntimeError, match=r"No trace is running: xshard.profiler.start_trace"):
        xp.stop_trace()
    xp.start_trace(str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match=r"stop_trace\(\) before starting another"):
            xp.start_trace(str(tmp_path))
    finally:
        xp.stop_trace()
    with pytest.raises(TypeError, match=r"non-empty str, e.g. 'forward'; got 3"):
        xp.Trace(3)
    with pytest.raises(TypeError, match=r"step_num must be an int"):
        xp.StepTrace("s", step_num="1")
    with pytest.raises(ValueError, match=r"port must be an int in 1..65535"):
        xp.start_server(0)
    with pytest.raises(ValueError, match=r"host_tracer_level must be 1, 2 or 3"):
        xp.start_trace(str(tmp_path), host_tracer_level=5)
    with pytest.raises(RuntimeError, match=r"No profiler server is running"):
        xp.stop_server()
    with pytest.raises(ValueError, match=r"service_addr must be 'host:port'"):
        xp.trace("", str(tmp_path))
    with pytest.raises(ValueError, match=r"duration_ms must be an int >= 1"):
        xp.trace("127.0.0.1:1", str(tmp_path), duration_ms=0)


def test_a_log_dir_that_cannot_be_written_is_refused_at_start(tmp_path):
    """JAX writes at stop_trace; a failed write there left its profiler unable to start again."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for bad in (afile, afile / "below"):
        with pytest.raises(ValueError, match=r"cannot write a trace into log_dir .*afile"):
            xp.start_trace(bad)
    xp.start_trace(tmp_path / "created")  # still usable, and a missing directory is created
    assert xp.stop_trace().startswith(str(tmp_path / "created"))


def test_a_trace_started_by_jax_is_named_in_the_error(tmp_path):
    import jax

    jax.profiler.start_trace(str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match=r"Call jax.profiler.stop_trace\(\) \(it was"):
            xp.start_trace(tmp_path)
    finally:
        jax.profiler.stop_trace()


def test_traces_written_within_one_second_keep_their_own_runs(tmp_path):
    """JAX names a run after the second it is written in: the second trace waits for the next."""
    runs = []
    for name in ("first", "second"):
        xp.start_trace(tmp_path)
        with xp.Trace(name):
            (torch.ones(3, device=DEV) * 2).sum().item()
        runs.append(xp.stop_trace())
    assert runs[0] != runs[1]
    names = [{e[2] for e in _events(run)} for run in runs]
    assert "first" in names[0] and "second" not in names[0]
    assert "second" in names[1] and "first" not in names[1]


def test_remote_capture_needs_xprof(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "xprof", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "xprof.convert", None)
    with pytest.raises(ImportError, match=r"pip install 'xshard\[profile\]'.*start_trace"):
        xp.trace("127.0.0.1:9012", str(tmp_path), duration_ms=100)


def test_remote_capture_client_calls_xprof(monkeypatch, tmp_path):
    calls = []

    def capture(addresses, logdir, workers, include_dataset_ops, duration_ms, attempts, options):
        calls.append((addresses, logdir, workers, include_dataset_ops, duration_ms, attempts,
                      options))
        if len(calls) < 3:
            raise RuntimeError("UNAVAILABLE: no server yet")
        os.makedirs(os.path.join(logdir, "plugins", "profile", "run1"))

    monkeypatch.setattr(xp, "_xprof_capture", lambda: capture)
    run = xp.trace("grpc://127.0.0.1:9012", str(tmp_path), duration_ms=1500, delay_ms=5,
                   timeout_s=10, interval_s=0)
    assert run == os.path.join(str(tmp_path), "plugins", "profile", "run1")
    assert len(calls) == 3  # retried while the server was unreachable
    assert calls[-1] == ("127.0.0.1:9012", str(tmp_path), "", True, 1500, 3,
                         {"host_tracer_level": 2, "device_tracer_level": 1, "delay_ms": 5})
    calls.clear()
    with pytest.raises(RuntimeError, match=r"Could not collect a trace from 127.0.0.1:9012 "
                                           r"within timeout_s=0.*start_server"):
        xp.trace("127.0.0.1:9012", str(tmp_path), timeout_s=0, interval_s=0)
    assert len(calls) == 1


_TARGET = """
import os, sys, time
os.environ["XSHARD_CPU_DEVICES"] = "2"
import torch, xshard, xshard.profiler as xp
server = xp.start_server(int(sys.argv[1]))
dev = xshard.device()
w = torch.randn(32, 32).to(dev)
print("ready", flush=True)
end = time.time() + 20
step = 0
while time.time() < end:
    with xp.StepTrace("remote_step", step_num=step):
        w = (w @ w).tanh()
    w.cpu()
    step += 1
"""


@pytest.mark.slow
def test_remote_capture_from_a_server(tmp_path):
    """start_server in a training process, trace() from here (jax's server listens on every
    interface; the client connects over loopback)."""
    pytest.importorskip("xprof")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_TARGET), str(port)],
                            stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1)
        run = xp.trace(f"127.0.0.1:{port}", str(tmp_path), duration_ms=1500, timeout_s=30)
        names = {e[2] for e in _events(run)}
        assert "remote_step" in names and "xshard.sync" in names
        assert any(n.startswith("PjitFunction(jit(xshard_") for n in names)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_plot_script_draws_the_trace(traced, tmp_path):
    """scripts/plot_trace.py (the README's picture) reads the trace JSON and finds every kind of
    span in it."""
    pytest.importorskip("matplotlib")
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "plot_trace.py")
    spec = importlib.util.spec_from_file_location("plot_trace", path)
    plot_trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_trace)
    run_dir, _, _ = traced
    steps, user, xshard_spans, devices = plot_trace.classify(*plot_trace.load(run_dir))
    assert len(steps) == 3 and {e["name"] for e in user} == {"fwd_bwd"}
    assert {e["name"] for e in xshard_spans} == XSHARD_SPANS
    assert devices  # XLA's CPU client threads executed the program
    out = tmp_path / "timeline.png"
    assert plot_trace.main([run_dir, "--steps", "1", "2", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_names_stay_out_of_the_multi_process_program_digest():
    """Processes compare program digests before running; a name (the triggering function and a
    per-process count) is display only and must not make equal programs differ."""
    from xshard.core import compiler, divergence, graph

    a = torch.randn(3, 29).to(DEV)
    pending = api.value((a * 3).cos())
    with core_trace.naming("first"):
        one = compiler.lower(graph.Graph([pending]))
    with core_trace.naming("second"):
        two = compiler.lower(graph.Graph([pending]))
    assert "module @jit_xshard_first_" in one.as_text()
    assert "module @jit_xshard_second_" in two.as_text()
    assert divergence.program_digest(one) == divergence.program_digest(two)
