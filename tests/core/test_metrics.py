"""Metrics in PyTorch/XLA's names: counters and metrics after a known number of compiles, cache
hits, syncs, transfers and CPU fallbacks; the report in PyTorch/XLA's text format, parsed with
regexes of that format; clearing; bad names."""

import re
import warnings

import pytest
import torch

import xshard
from xshard.core import metrics as met

DEV = xshard.device()


def fresh(*shape):
    t = torch.randn(*shape).to(DEV)
    xshard.sync()
    return t


@pytest.fixture
def cleared():
    """Every counter and metric at zero for the test; the executable cache is kept."""
    met.clear_all()
    yield
    met.clear_all()


def test_counters_and_metrics_after_known_work(cleared):
    a = fresh(5, 11)
    met.clear_all()
    (a.sin() * 3 - a).cpu()  # graph 1 (shapes and ops no other test uses): compiled
    (a.sin() * 3 - a).cpu()  # graph 1 again: from the cache
    b = torch.randn(6, 11).to(DEV)  # an upload
    y = b.sin() * 3 - b  # graph 2: another input shape, compiled
    xshard.sync()
    xshard.sync()  # nothing pending: a MarkStep all the same
    y.cpu()

    assert met.counter_value("UncachedCompile") == 2
    assert met.counter_value("CachedCompile") == 1
    assert met.counter_value("MarkStep") == 2
    compile_data = met.metric_data("CompileTime")
    assert compile_data[0] == 2
    total, accumulator, samples = met.metric_data("ExecuteTime")
    assert total == 3 == len(samples)  # 3 graphs run
    assert accumulator == pytest.approx(sum(v for _, v in samples))
    assert all(isinstance(t, int) and v > 0 for t, v in samples)
    assert met.metric_data("TransferToDeviceTime")[0] == 1
    assert met.metric_data("TransferFromDeviceTime")[0] == 3  # three .cpu() reads
    # One TraceTime sample per sync that ends a recording: the two reads that ran graphs and the
    # explicit sync (the second sync and the last read recorded nothing new).
    assert met.metric_data("TraceTime")[0] == 3
    snap = met.snapshot()
    assert snap["compiles"] == met.counter_value("UncachedCompile")
    assert snap["executions"] == 3
    assert snap["compile_seconds"] * 1e9 == pytest.approx(compile_data[1])
    assert met.metric_names() == ["CompileTime", "ExecuteTime", "TraceTime",
                                  "TransferFromDeviceTime", "TransferToDeviceTime"]
    assert met.counter_names() == ["CachedCompile", "MarkStep", "UncachedCompile"]
    assert met.executed_fallback_ops() == []


def test_cpu_fallbacks_are_aten_counters(cleared):
    # aten::nonzero has a data-dependent output shape: it runs through the counted CPU fallback.
    x = fresh(4, 3)
    met.clear_all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback warns once per process
        idx = torch.nonzero(x > 0)
        torch.nonzero(x < 0)
    assert idx.shape == torch.nonzero(x.cpu() > 0).shape
    assert met.counter_value("aten::nonzero") == 2
    assert met.executed_fallback_ops() == ["aten::nonzero"]
    assert "aten::nonzero" in met.counter_names()
    assert met.snapshot()["cpu_fallbacks"] == {"aten.nonzero.default": 2}
    # A short report always lists the fallback counters, asked for or not.
    short = met.short_metrics_report(counter_names=["MarkStep"], metric_names=["CompileTime"])
    assert "Counter: aten::nonzero\n  Value: 2\n" in short


# The report's format, as PyTorch/XLA's tools (metrics_compare_utils) read it.
_METRIC = re.compile(
    r"Metric: (?P<name>\S+)\s+TotalSamples: (?P<total>\d+)\s+Accumulator: (?P<acc>\S+)[^P]+"
    r"Percentiles: 1%=(?P<p1>\S+); 5%=\S+; 10%=\S+; 20%=\S+; 50%=(?P<p50>\S+); 80%=\S+; "
    r"90%=\S+; 95%=\S+; 99%=(?P<p99>\S+)")
_COUNTER = re.compile(r"Counter: (?P<name>\S+)\s+Value: (?P<value>\d+)")
_DURATION = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?(?:(\d+)ms)?([\d.]+)us$")


def _ns(text: str) -> float:
    m = _DURATION.match(text)
    assert m, f"not a duration in PyTorch/XLA's format: {text!r}"
    d, h, mi, s, ms, us = (float(g) if g else 0.0 for g in m.groups())
    return ((((d * 24 + h) * 60 + mi) * 60 + s) * 1e3 + ms) * 1e6 + us * 1e3


def test_report_parses_with_torch_xla_format(cleared):
    a = fresh(3, 7)
    for _ in range(3):
        (a.cos() + 1).cpu()
    xshard.sync()
    report = met.metrics_report()
    metrics = {m["name"]: m for m in _METRIC.finditer(report)}
    counters = {m["name"]: int(m["value"]) for m in _COUNTER.finditer(report)}
    assert set(metrics) == set(met.metric_names())
    assert set(counters) == set(met.counter_names())
    assert report.count("Metric: ") == len(metrics) and report.count("Counter: ") == len(counters)
    for name, m in metrics.items():
        total, accumulator, samples = met.metric_data(name)
        assert int(m["total"]) == total
        assert _ns(m["acc"]) == pytest.approx(accumulator, abs=1.0)  # printed to the ns
        values = sorted(v for _, v in samples)
        assert _ns(m["p1"]) == pytest.approx(values[0], abs=1.0)
        assert _ns(m["p99"]) == pytest.approx(values[-1], abs=1.0)
    for name, value in counters.items():
        assert met.counter_value(name) == value
    # Metrics first, each group sorted by name.
    names = re.findall(r"^(Metric|Counter): (\S+)$", report, flags=re.M)
    assert names == sorted(names, key=lambda kn: (kn[0] != "Metric", kn[1]))
    assert "ExecuteTime" in metrics and metrics["ExecuteTime"]["total"] == "3"
    assert re.search(r"ExecuteTime\n  TotalSamples: 3\n  Accumulator: \S+\n  ValueRate: \S+ / "
                     r"second\n  Rate: [\d.e+-]+ / second\n  Percentiles: ", report)


def test_format_time_matches_torch_xla():
    assert met.format_time(369_401_746_001) == "06m09s401ms746.001us"
    assert met.format_time(500) == "000.500us"
    assert met.format_time(1_500_000) == "001ms500.000us"
    assert met.format_time(2 * 86400e9 + 3e9) == "02d00h00m03s000ms000.000us"
    for ns in (1, 999, 12_345_678, 3_723_004_005_006):
        assert _ns(met.format_time(ns)) == pytest.approx(ns, abs=0.5)


def test_short_report_defaults_and_selection(cleared):
    a = fresh(2, 9)
    (a * 2).cpu()
    short = met.short_metrics_report()
    shown = re.findall(r"^(?:Metric|Counter): (\S+)$", short, flags=re.M)
    assert shown == [n for n in ("CompileTime", "ExecuteTime", "TransferToDeviceTime",
                                 "TransferFromDeviceTime", "CachedCompile", "MarkStep")
                     if n in met.metric_names() + met.counter_names()]
    assert "TraceTime" not in short  # not among the defaults
    only = met.short_metrics_report(counter_names=["MarkStep"], metric_names=["TraceTime"])
    assert re.findall(r"^(?:Metric|Counter): (\S+)$", only, flags=re.M) == ["TraceTime",
                                                                         "MarkStep"]
    with pytest.raises(TypeError, match=r"metric_names must be a list of names"):
        met.short_metrics_report(metric_names="CompileTime")


def test_inactive_names_and_clearing(cleared):
    assert met.counter_value("NoSuchCounter") is None
    assert met.metric_data("NoSuchMetric") is None
    with pytest.raises(TypeError, match=r"Counter names are strings.*got 3"):
        met.counter_value(3)
    with pytest.raises(TypeError, match=r"Metric names are strings"):
        met.metric_data(None)
    a = fresh(4, 13)
    (a + 1).cpu()
    assert met.counter_names() and met.metric_names()
    met.clear_counters()
    assert met.counter_names() == [] and met.metric_names()
    assert met.counter_value("MarkStep") is None
    assert met.snapshot()["executions"] == 0 and met.snapshot()["execute_seconds"] > 0
    met.clear_metrics()
    assert met.metric_names() == [] and met.metric_data("ExecuteTime") is None
    assert met.snapshot()["execute_seconds"] == 0
    assert met.metrics_report() == ""
    (a + 1).cpu()
    met.reset()  # xshard's own reset clears both
    assert met.counter_names() == [] and met.metric_names() == []


def test_samples_are_bounded(cleared):
    for i in range(met.MAX_SAMPLES + 10):
        met.record_trace(1e-6)
    total, accumulator, samples = met.metric_data("TraceTime")
    assert total == met.MAX_SAMPLES + 10 and len(samples) == met.MAX_SAMPLES
    assert accumulator == pytest.approx(1e3 * total)
