"""Divergence is an error: before a program runs, every process checks the others run the same.

JAX's multi-controller runtime trusts every process to run the same programs in the same order.
When they do not, nothing stops them: two programs with the same collectives finish with wrong
numbers, and a process that skips one hangs its peers. xshard turns both into errors here.

[Note: the sync check]
Before each program runs (a sync, an ``evaluate``, the gather of a collective read), with a counter
``k`` that every process advances alike:

1. publish ``{program digest, scalars digest, upload digest, kind, call site}`` under
   ``xshard/c/<process>/<k // 64>/<k>`` in the coordinator's key-value store;
2. read every other process's entry for ``k`` (blocking reads in slices of a second; between slices,
   look for processes that failed or exited, under ``xshard/fail/``);
3. all equal: run. Otherwise every process sees the same difference and acts alike: if the programs
   differ, collect garbage once and try again (a dead tensor kept alive by a reference cycle on one
   process only adds an output to its program); still different, each publishes a description (the
   program's ops, scalars and uploads) and raises ``MultiProcessDivergenceError`` naming each
   process's call site and the first difference;
4. a process that does not arrive within ``XSHARD_SYNC_TIMEOUT`` seconds: ``MultiProcessTimeoutError``
   naming the missing processes and where they were last seen; a process that published an error
   or exited: the same error, quoting it, at once.

The program digest is the sha256 of the lowered StableHLO text (donation marks removed: which
buffers a process may reuse is its own business), computed once per executable at compile time:
equal across processes (device ids appear as positions) and independent of ``PYTHONHASHSEED``.
The scalars digest covers the Python numbers the program takes as inputs (learning rates, the random
stream's seed and position), so per-process seeds are caught. The upload digest folds a sampled
digest (shape, dtype, blake2b of at most 16 Ki elements taken with a stride) of every value copied
to the devices since the previous check, so unequal data (an unseeded model init) is caught where
``jax.device_put`` would have run a hidden all-gather to compare it. Data loaded per process
(``ShardingSpec(..., minibatch=True)``) is not uploaded this way and is exempt.

Cost: one key-value write and one read per other process per sync (about 1 ms on loopback for two
processes; ``benchmarks/bench_multihost.py``). ``XSHARD_CHECK=off`` skips it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import linecache
import re
import threading
import time

import numpy as np

from xshard.core import distributed, runtime

_BLOCK = 64             # checks per key block: a process deletes its blocks two behind
_SLICE_S = 1.0          # a blocking read waits this long before looking for failed processes
_SAMPLE = 16384         # elements an upload digest reads at most
_MAX_RECORDS = 4096     # uploads remembered per check (for the message; the digest covers all)
_MAX_OPS = 20000        # ops per process in a mismatch description


class MultiProcessDivergenceError(RuntimeError):
    """The processes of a multi-process run are about to run different device work, or copied
    different values to the devices. Raised on every process, before anything runs."""


class MultiProcessTimeoutError(MultiProcessDivergenceError):
    """A process did not reach a sync (or collective read) that another one waits at: it is
    elsewhere, has failed, or has exited."""


class _RetryAfterGC(Exception):
    """Internal: the programs differed once; rebuild the pending step after ``gc.collect()``."""


# -- call sites ------------------------------------------------------------------------------------


site = distributed.site


def _with_source(where: str) -> str:
    path, _, line = where.rpartition(":")
    text = linecache.getline(path, int(line)).strip() if line.isdigit() else ""
    return f"{where} `{text}`" if text else where


# -- digests ---------------------------------------------------------------------------------------


def sample_digest(array: np.ndarray) -> str:
    """A digest of ``array``'s shape, dtype and at most 16 Ki elements taken with a stride."""
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.size > _SAMPLE:
        flat = np.ascontiguousarray(flat[::flat.size // _SAMPLE][:_SAMPLE])
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{tuple(array.shape)}|{array.dtype.str}|".encode())
    h.update(flat.view(np.uint8).tobytes())
    return h.hexdigest()


# Donation marks an input's buffer as reusable: a local matter (which buffers this process still
# holds), not part of what the processes must agree on.
_DONATION = re.compile(r"(jax\.buffer_donor = true|tf\.aliasing_output = \d+ : i32)(, )?")
# The module's name is the program's display name (see [Note: executable names] in
# xshard.core.trace: the function that triggered the sync, and a per-process count), not its content.
_MODULE_NAME = re.compile(r"^module @\S+", re.M)


def program_digest(lowered) -> str:
    """sha256 (16 hex digits) of a lowered program's StableHLO text without donation marks. Equal
    across processes (device ids appear as positions) and independent of ``PYTHONHASHSEED``."""
    text = _DONATION.sub("", lowered.as_text()).replace(", }", "}").replace(" {}", "")
    text = _MODULE_NAME.sub("module @program", text, count=1)
    return text_digest(text)


def lowered_digest(lowered) -> str | None:
    """``program_digest`` in a multi-process run; None in one process (nothing compares it)."""
    return program_digest(lowered) if _enabled() else None


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- state ---------------------------------------------------------------------------------------


class _Checks:
    counter = 0                 # the next check's index, advanced alike on every process
    retrying = False
    uploads = hashlib.blake2b(digest_size=8)
    upload_count = 0
    records: list = []          # (label, site, digest) of this check's uploads (the first few)
    lock = threading.Lock()


_LOCAL = threading.local()


def _enabled() -> bool:
    return distributed.ACTIVE and runtime.distributed_settings().check != "off"


def _collectives_enabled() -> bool:
    # Also in the local world (xshard.compat's replicas): their syncs are their own, but the
    # collectives they make together are checked (see [Note: the local world] in core.runtime).
    return distributed.num_processes() > 1 and runtime.distributed_settings().check != "off"


# -- uploads ----------------------------------------------------------------------------------------


def record_upload(host: np.ndarray, label: str | None = None) -> None:
    """Adds a value copied to the devices (as every process should copy it) to the next check."""
    if not _enabled():
        return
    record = (label or f"a {tuple(host.shape)} {host.dtype} tensor", site(), sample_digest(host))
    collector = getattr(_LOCAL, "collector", None)
    if collector is not None:
        collector.append(record)
    else:
        add_uploads([record])


def add_uploads(records: list) -> None:
    """Adds uploads collected elsewhere (``collect_uploads``) to the next check, in order."""
    with _Checks.lock:
        for record in records:
            _Checks.uploads.update(record[2].encode())
            _Checks.upload_count += 1
            if len(_Checks.records) < _MAX_RECORDS:
                _Checks.records.append(record)


@contextlib.contextmanager
def collect_uploads():
    """In a background thread: collects this thread's uploads in a list instead of adding them to
    the next check at once (when they happen is timing). Hand the list to ``add_uploads`` where the
    data is used (``MpDeviceLoader`` does, when it hands out the batch)."""
    previous = getattr(_LOCAL, "collector", None)
    records: list = []
    _LOCAL.collector = records
    try:
        yield records
    finally:
        _LOCAL.collector = previous


def _take_uploads() -> tuple[str, list, int]:
    with _Checks.lock:
        digest = _Checks.uploads.hexdigest()
        records, count = _Checks.records, _Checks.upload_count
        _Checks.uploads = hashlib.blake2b(digest_size=8)
        _Checks.records = []
        _Checks.upload_count = 0
    return digest, records, count


def _peek_uploads() -> str:
    with _Checks.lock:
        return _Checks.uploads.copy().hexdigest()


# -- the check -------------------------------------------------------------------------------------


def before_run(exe, graph, kind: str = "sync", scalars=None) -> None:
    """Before ``exe`` runs ``graph``: checks every process runs the same program on equal uploads.

    A sync's pending step is rebuilt once after garbage collection if the programs differ (see
    [Note: the sync check]); ``retry_after_gc`` on the caller does that. ``scalars``: for a program
    run again on other numbers than its graph's (a compiled step's replay, see xshard.step), a
    function returning the Python numbers it runs on now, called only when processes compare.
    """
    if not _enabled():
        return
    numbers = _scalars(graph) if scalars is None else [_scalar_text(v) for v in scalars()]
    entry = {"p": exe.digest or "unknown", "k": kind, "o": _op_count(graph),
             "v": text_digest("|".join(numbers))}
    _check(entry, lambda: _describe_graph(graph), rebuild=kind == "sync")


def nothing_to_run() -> None:
    """A sync with nothing pending: checked only while the processes retry a differing sync."""
    if _enabled() and _Checks.retrying:
        _check({"p": "nothing", "k": "sync with nothing pending", "o": 0},
               lambda: {"inputs": [], "ops": []}, rebuild=False)


def before_collective(digest: str, kind: str, what: str) -> None:
    """Before a collective outside a sync (the gather of a read): the same check."""
    if not _collectives_enabled():
        return
    entry = {"p": digest, "k": kind, "o": 1, "w": what}
    _check(entry, lambda: {"inputs": [], "ops": [f"{kind}: {what}"]}, rebuild=False)


def exchange(kind: str, payload: str) -> list[str]:
    """Every process's ``payload`` for a check named ``kind`` (process order). Every process must
    call it at the same point; what it does with differing payloads is the caller's business."""
    if not _collectives_enabled():
        return [payload]
    entries = _check({"p": f"exchange: {kind}", "k": kind, "o": 0, "x": payload},
                     lambda: {"inputs": [], "ops": [kind]}, rebuild=False)
    return [e["x"] for e in entries]


def retry_after_gc(fn):
    """Runs ``fn`` (a sync) again once if its check asks for it (see [Note: the sync check])."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _RetryAfterGC:
            return fn(*args, **kwargs)
    return wrapper


def _check(entry: dict, describe, rebuild: bool) -> list[dict]:
    entry["s"] = site()
    while True:
        entry["u"] = _peek_uploads()
        n, entries = _exchange(entry)
        if all((e["p"], e["u"], e.get("v")) == (entry["p"], entry["u"], entry.get("v"))
               for e in entries):
            _Checks.retrying = False
            _take_uploads()
            return entries
        if len({e["p"] for e in entries}) > 1 and not _Checks.retrying:
            # Every process sees the same entries, so every process retries.
            _Checks.retrying = True
            gc.collect()
            if rebuild:
                raise _RetryAfterGC()
            continue
        _Checks.retrying = False
        _, records, count = _take_uploads()
        mine = describe()
        mine["uploads"] = [list(r) for r in records]
        mine["upload_count"] = count
        raise MultiProcessDivergenceError(_mismatch_message(n, entries, _details(n, mine)))


def _key(process: int, n: int) -> str:
    return f"xshard/c/{process}/{n // _BLOCK}/{n}"


def _exchange(entry: dict) -> tuple[int, list[dict]]:
    kv = distributed.kv()
    me, count = distributed.process_id(), distributed.num_processes()
    n = _Checks.counter
    _Checks.counter += 1
    distributed.note_check(_Checks.counter, entry["s"])
    kv.set(_key(me, n), json.dumps(entry))
    timeout = runtime.distributed_settings().sync_timeout
    start = time.monotonic()
    entries: list = [None] * count
    entries[me] = entry
    for peer in range(count):
        if peer != me:
            entries[peer] = _wait_for(peer, n, start, timeout, entries, entry)
    if n % _BLOCK == 0 and n >= 2 * _BLOCK:
        # Every peer has published n, so has read all of ours up to n - 1 (see the Note).
        kv.delete(f"xshard/c/{me}/{n // _BLOCK - 2}")
    return n, entries


def _wait_for(peer: int, n: int, start: float, timeout: float, entries: list, mine: dict) -> dict:
    kv = distributed.kv()
    key = _key(peer, n)
    while True:
        remaining = timeout - (time.monotonic() - start)
        try:
            value = kv.get(key, max(0.001, min(_SLICE_S, remaining)))
        except distributed.CoordinatorUnavailableError as e:
            raise MultiProcessTimeoutError(
                f"process {distributed.process_id()} lost the coordinator (process 0) at check "
                f"#{n} ({mine['k']} at {_with_source(mine['s'])}): {e}. Process 0 has probably "
                f"ended; its own output says why.") from e
        if value is not None:
            return json.loads(value)
        missing = [p for p, e in enumerate(entries) if e is None]
        failed = distributed.failures()
        ended = {p: f for p, f in failed.items() if p in missing or f["kind"] == "error"}
        if ended:
            raise MultiProcessTimeoutError(_ended_message(n, mine, ended))
        if time.monotonic() - start >= timeout:
            missing = [p for p in missing if kv.try_get(_key(p, n)) is None]
            raise MultiProcessTimeoutError(_timeout_message(n, mine, missing, timeout))


def _details(n: int, mine: dict) -> list:
    """Every process's description of what it was about to run (published on mismatch only)."""
    kv = distributed.kv()
    me, count = distributed.process_id(), distributed.num_processes()
    kv.set(f"xshard/d/{n}/{me}", json.dumps(mine))
    out = []
    for p in range(count):
        if p == me:
            out.append(mine)
            continue
        value = kv.get(f"xshard/d/{n}/{p}", min(10.0, runtime.distributed_settings().sync_timeout))
        out.append(json.loads(value) if value is not None else None)
    return out


# -- descriptions and messages -------------------------------------------------------------------


def _op_count(graph) -> int:
    return len(graph.order) - len(graph.inputs)


def _scalars(graph) -> list[str]:
    """The Python numbers a program runs on (its scalar inputs: a learning rate, the random
    stream's seed and position...), exactly, with their types."""
    from xshard.core import ir

    return [_scalar_text(n.payload) for n in graph.inputs if n.op is ir.SCALAR]


def _scalar_text(value) -> str:
    return f"{type(value).__name__}:{value!r}"


def _describe_graph(graph) -> dict:
    from xshard.core import ir

    def value(shape, dtype):
        return f"{tuple(shape)} {str(dtype).replace('torch.', '')}"

    def values(node):  # a multi-output node (cross_entropy's, dropout's) has one per output
        if node.outputs is None:
            return value(node.shape, node.dtype)
        return ", ".join("-" if o is None else value(*o) for o in node.outputs)

    inputs = [("scalar " if n.op is ir.SCALAR else "") + values(n) for n in graph.inputs]
    ops = [f"{n.op} {values(n)}" for n in graph.order
           if n.op is not ir.DATA and n.op is not ir.SCALAR][:_MAX_OPS]
    roles = {}
    for n in graph.order:
        if n.op is ir.RNG_KEY:
            roles[id(n.inputs[0])] = "seed"
            roles[id(n.inputs[1])] = "position"
    scalars = [[roles.get(id(n), "scalar"), repr(n.payload)] for n in graph.inputs
               if n.op is ir.SCALAR]
    return {"inputs": inputs, "ops": ops, "scalars": scalars}


def _where(entry: dict) -> str:
    what = f" of {entry['w']}" if entry.get("w") else ""
    return f"{entry['k']}{what} at {_with_source(entry['s'])}"


_READ_RULE = (
    "Every process must run the same device work in the same order: reads of pending or sharded "
    "values (.item(), .cpu(), print of a device tensor) and xshard.sync() are collective, so make "
    "them on every process, then log from one (xshard.is_main_process()); see the README, "
    "\"Multi-host\".")

_DATA_RULE = (
    "Values copied to the devices must be equal on every process: seed every process alike "
    "(torch.manual_seed(s) with the same s), load the same data, or load per-process data through "
    "MpDeviceLoader with ShardingSpec(..., minibatch=True).")

_NUMBER_RULE = (
    "Python numbers used in device ops (a learning rate, a loss scale, a step count) must be equal "
    "on every process.")

_SEED_RULE = (
    "Call torch.manual_seed(s) (or xshard.manual_seed(s)) with the same s on every process, and "
    "run random device ops on every process alike; for per-process host randomness (data "
    "augmentation), use a torch.Generator seeded per rank.")


def _first_difference(key: str, details: list) -> str | None:
    lists = [d[key] for d in details if d is not None]
    if len(lists) < 2:
        return None
    for i in range(max(len(x) for x in lists)):
        column = [x[i] if i < len(x) else None for x in lists]
        if len(set(column)) > 1:
            name = "op" if key == "ops" else "input"
            parts = [f"process {p} has {d[key][i] if i < len(d[key]) else 'nothing'}"
                     for p, d in enumerate(details) if d is not None]
            return f"{name} {i}: " + "; ".join(parts)
    return None


def _mismatch_message(n: int, entries: list, details: list) -> str:
    lines = []
    programs_agree = len({e["p"] for e in entries}) == 1
    if programs_agree:
        lines.append(f"the processes are about to run the same program at check #{n}, but the "
                     f"values they copied to the devices since the previous check differ:")
    else:
        lines.append(f"the processes are about to run different device programs at check #{n}:")
    for p, e in enumerate(entries):
        lines.append(f"  process {p}: {_where(e)} (program {e['p']}, {e['o']} ops)")
    if not programs_agree:
        first = _first_difference("ops", details) or _first_difference("inputs", details)
        if first:
            lines.append(f"First difference: {first}.")
        lines.append(_READ_RULE)
        return "\n".join(lines)
    lines.append(_scalar_difference(details) if len({e.get("v") for e in entries}) > 1
                 else _upload_difference(details))
    return "\n".join(lines)


def _scalar_difference(details: list) -> str:
    known = [(p, d) for p, d in enumerate(details) if d is not None and "scalars" in d]
    if len(known) < 2:
        return _NUMBER_RULE
    for i in range(min(len(d["scalars"]) for _, d in known)):
        column = {p: d["scalars"][i] for p, d in known}
        if len({v for _, v in column.values()}) > 1:
            role = next(iter(column.values()))[0]
            values = "; ".join(f"process {p}: {v}" for p, (_, v) in column.items())
            if role == "seed":
                return f"The device random seeds differ ({values}). {_SEED_RULE}"
            if role == "position":
                return (f"The device random streams are at different positions (random values "
                        f"drawn since seeding: {values}): a random op ran on some processes "
                        f"only. {_SEED_RULE}")
            return f"Scalar input {i} of the program differs ({values}). {_NUMBER_RULE}"
    return _NUMBER_RULE


def _upload_difference(details: list) -> str:
    known = [(p, d) for p, d in enumerate(details) if d is not None]
    counts = {p: d["upload_count"] for p, d in known}
    records = {p: d["uploads"] for p, d in known}
    depth = min(len(r) for r in records.values()) if records else 0
    for i in range(depth):
        column = {p: records[p][i] for p in records}
        if len({r[2] for r in column.values()}) > 1:
            where = "; ".join(f"process {p}: {r[0]} at {_with_source(r[1])} (digest {r[2]})"
                              for p, r in column.items())
            return (f"First differing value: upload {i} of {max(counts.values())}: {where}. "
                    f"{_DATA_RULE}")
    if len(set(counts.values())) > 1:
        per = ", ".join(f"process {p} copied {c}" for p, c in counts.items())
        return f"The processes copied different numbers of values to the devices ({per}). " + \
            _DATA_RULE
    return _DATA_RULE


def _last_seen(process: int) -> str:
    best = None
    try:
        items = distributed.kv().items(f"xshard/c/{process}")
    except distributed.CoordinatorUnavailableError:
        items = []
    for key, value in items:
        k = int(key.rsplit("/", 1)[1])
        if best is None or k > best[0]:
            best = (k, json.loads(value))
    if best is None:
        return f"process {process} has not reached any check yet"
    return f"process {process} at check #{best[0]} ({_where(best[1])})"


def _timeout_message(n: int, mine: dict, missing: list, timeout: float) -> str:
    me = distributed.process_id()
    who = ", ".join(str(p) for p in missing)
    seen = "; ".join(_last_seen(p) for p in missing)
    return (f"process {me} waited {timeout:g} s at check #{n} ({_where(mine)}) for process"
            f"{'es' if len(missing) > 1 else ''} {who}, which did not arrive; last seen: {seen}.\n"
            f"A process that skips a sync or a collective read that the others make (a "
            f"rank-specific .item(), .cpu() or print of a pending or sharded value) is the usual "
            f"cause. {_READ_RULE} Raise XSHARD_SYNC_TIMEOUT (now {timeout:g} s) if a process is "
            f"legitimately slower, e.g. compiling a large program.")


def _ended_message(n: int, mine: dict, ended: dict) -> str:
    me = distributed.process_id()
    parts = []
    for p, f in sorted(ended.items()):
        if f["kind"] == "error":
            at = f" (at {_with_source(f['site'])})" if f.get("site") else ""
            parts.append(f"process {p} failed: {f['text']}{at}")
        else:
            last = f", the last at {_with_source(f['site'])}" if f.get("site") else ""
            parts.append(f"process {p} exited ({f['text']}{last}), so it will not run the device "
                         f"work process {me} waits at")
    return (f"process {me} stops at check #{n} ({_where(mine)}): " + "; ".join(parts) + ".")


__all__ = ["MultiProcessDivergenceError", "MultiProcessTimeoutError", "before_run",
           "before_collective", "nothing_to_run", "exchange", "record_upload", "add_uploads",
           "collect_uploads", "retry_after_gc", "sample_digest", "program_digest", "lowered_digest",
           "site"]
