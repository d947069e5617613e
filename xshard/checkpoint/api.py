"""save and load: a DCP checkpoint directory written atomically, loaded with nothing half done.

[Note: atomic checkpoints]
DCP writes the data files of every process and then, last, the coordinator's ``.metadata``; a save
killed part-way can leave data files (and, killed late, even ``.metadata``) at the path. So ``save``
writes into ``<path>.partial`` and only when DCP has finished on every process does process 0
rename it to ``<path>``, after which every process returns. A directory at ``<path>`` is therefore
always a finished checkpoint; ``load`` refuses a path without ``.metadata`` and names the leftover
``.partial`` directory if there is one; the next save to that path removes it first. The steps
that touch the directory run on process 0, which then tells the others how they went (a broadcast,
which is also the barrier), so an error there is raised on every process instead of a hang.

``load`` checks the whole state against the checkpoint's metadata before reading anything (see
``planner.check_state``), keeps every value it reads on the host, and writes them into the state
only once every read has succeeded.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from xshard.checkpoint import state as states
from xshard.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from xshard.checkpoint.planner import LoadPlanner, SavePlanner, check_process_group

__all__ = ["save", "async_save", "load"]

PARTIAL_SUFFIX = ".partial"
METADATA_FILE = ".metadata"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _on_process_0(step, group=None) -> None:
    """Runs ``step()`` on process 0 only; every process returns once it has, and raises if it
    failed. ``group``: the process group to tell the others through (None: the default)."""
    if not _distributed():
        step()
        return
    outcome = [None]
    if dist.get_rank() == 0:
        try:
            step()
        except Exception as e:  # reported to the others below, then re-raised here
            outcome = [f"{type(e).__name__}: {e}"]
            dist.broadcast_object_list(outcome, src=0, group=group)
            raise
    dist.broadcast_object_list(outcome, src=0, group=group)
    if outcome[0] is not None:
        raise RuntimeError(f"process 0 failed while writing the checkpoint: {outcome[0]}")


_SINGLE_PROCESS_WARNING = "torch.distributed is disabled"


@contextlib.contextmanager
def _dcp_errors(what: str, consequence: str, quiet: bool = True):
    """DCP's single-process warning off (xshard means it), and DCP's errors (a
    ``CheckpointException``, which is not an ``Exception``, carrying each process's error) turned
    into ordinary ones: a ``CheckpointError`` from any process is raised as itself, anything else
    as a ``CheckpointError`` naming the processes and the first error."""
    with warnings.catch_warnings() if quiet else contextlib.nullcontext():
        if quiet:
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        try:
            yield
        except CheckpointException as e:
            ranks = sorted(e.failures)
            for rank in ranks:
                error = e.failures[rank][0]
                if isinstance(error, CheckpointError):
                    raise error from e
            first = e.failures[ranks[0]][0]
            where = "process " + ", ".join(map(str, ranks)) if len(ranks) < 2 else \
                "processes " + ", ".join(map(str, ranks))
            raise CheckpointError(f"{what} failed on {where} ({consequence}): "
                                  f"{type(first).__name__}: {first}") from e


def save(state: dict, path, *, overwrite: bool = False) -> None:
    """Writes ``state`` as a DCP checkpoint directory; each process writes only its own shards.

    Call on every process. Device tensors are written block by block, each block once over all
    processes (by the device holding its first replica), without gathering anything; CPU tensors
    and Python values are written by process 0. The directory appears at ``path`` only once the
    whole checkpoint is written (see [Note: atomic checkpoints]).

    Args:
        state: a dict, nested as you like, of tensors, Python values (a step count), state dicts
            (``model.state_dict()``, ``optimizer.state_dict()``), or the modules and optimizers
            themselves; a module (FSDP included) is saved as its sharded device tensors under the
            plain model's names; any other object with ``state_dict`` / ``load_state_dict``
            (an LR scheduler, a GradScaler, a stateful data loader) as its ``state_dict()``.
        path: the checkpoint directory (a shared file system when several hosts save).
        overwrite: replace an existing checkpoint at ``path``; by default that is an error.

    Raises:
        CheckpointError: ``path`` exists and ``overwrite`` is False, or is not a directory.

    Example:
        >>> import xshard.checkpoint as xcp
        >>> xcp.save({"model": model, "optim": opt, "step": 100}, "ckpt/100")  # doctest: +SKIP
    """
    _wait_for_async_save()
    path = _save_path(path, overwrite)
    check_process_group()
    _write(states.to_state_dicts(state, prime=False), path, SavePlanner())


def _save_path(path, overwrite) -> str:
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {overwrite!r}.")
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and (not overwrite or not os.path.isdir(path)):
        what = "a checkpoint" if os.path.isdir(path) else "a file, not a checkpoint directory,"
        raise CheckpointError(
            f"{path} already exists ({what}). Save to a new path (e.g. one per step), delete it "
            f"first, or pass overwrite=True to replace a checkpoint.", key=None)
    return path


def _write(to_write: dict, path: str, planner: SavePlanner, group=None, quiet=True) -> None:
    """Writes ``to_write`` into ``<path>.partial``, then commits it to ``path`` (see [Note:
    atomic checkpoints]); the collectives go through ``group`` (None: the default group).
    ``quiet``: DCP's single-process warning off around the save (main thread only)."""
    staging = path + PARTIAL_SUFFIX

    def fresh_staging():
        if os.path.exists(staging):  # left by an interrupted save
            shutil.rmtree(staging)
        os.makedirs(staging)

    _on_process_0(fresh_staging, group)
    writer = FileSystemWriter(staging, per_thread_copy_ahead=0, overwrite=False)
    with _dcp_errors(f"Saving {path}", f"nothing was committed; {staging} is left over and "
                     f"the next save to this path removes it", quiet=quiet):
        dcp.save(to_write, storage_writer=writer, planner=planner, process_group=group)
    _on_process_0(lambda: _commit(staging, path), group)


# [Note: asynchronous saves]
# async_save copies this process's share of the state to host memory (``SavePlanner.stage``: the
# blocks it writes, no gather) and returns; one background thread per process then writes and
# commits it as ``save`` does, while training goes on and changes the device tensors. Its
# collectives (DCP's plan exchange, the commit's broadcast) go through a gloo group of their own,
# created by the first async_save on every process, so they never interleave with the main
# thread's. At most one save is in flight: the next save, async_save or load waits for it, as
# does the interpreter's exit; a failed one raises from the future's result() and warns. Python
# values are pickled on the calling thread (the background one never touches a device tensor),
# and DCP's "torch.distributed is disabled" warning is filtered for the whole process by
# async_save, since warning filters cannot be set for one thread.
_ASYNC = {"executor": None, "world": None, "group": None, "pending": None}


def async_save(state: dict, path, *, overwrite: bool = False) -> concurrent.futures.Future:
    """``save``, returning as soon as the state is copied to host memory; the files are written
    and committed on a background thread.

    Call on every process. The state may change (a training step) right after it returns: what
    is saved is the state at the call. Holds this process's share of the state in host memory
    until written.

    Args:
        state, path, overwrite: as for ``save``.

    Returns:
        A ``concurrent.futures.Future``: ``result()`` returns None once the checkpoint is
        committed at ``path``, or raises the save's ``CheckpointError``.

    Example:
        >>> pending = xcp.async_save({"model": model, "optim": opt, "step": step},
        ...                          f"ckpt/{step}")  # doctest: +SKIP
        >>> ...  # training goes on
        >>> pending.result()  # doctest: +SKIP
    """
    _wait_for_async_save()
    path = _save_path(path, overwrite)
    check_process_group()
    planner = SavePlanner()
    staged = planner.stage(states.to_state_dicts(state, prime=False))
    if _ASYNC["executor"] is None:
        _ASYNC["executor"] = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="xshard-checkpoint")
    # Warning filters are the process's, not a thread's: set here (a filter already there is not
    # added twice), not switched on and off around the background save (see _dcp_errors).
    warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
    world = dist.group.WORLD if _distributed() else None
    if _ASYNC["world"] is not world:  # a new process group (or none): a new group of our own
        _ASYNC["world"] = world
        _ASYNC["group"] = dist.new_group(backend="gloo") if world is not None else None
    future = _ASYNC["executor"].submit(_write_staged, staged, path, planner, _ASYNC["group"])
    future.add_done_callback(_warn_if_failed)
    _ASYNC["pending"] = future
    return future


def _write_staged(staged: dict, path: str, planner: SavePlanner, group) -> None:
    try:
        _write(staged, path, planner, group, quiet=False)
    finally:  # a failure's traceback keeps these frames: let the host copy go
        staged.clear()
        planner.state_dict, planner._sources = {}, {}


def _warn_if_failed(future: concurrent.futures.Future) -> None:
    error = future.exception()
    if error is not None:  # raised by result() too; warned of for a caller that never asks
        warnings.warn(f"xshard.checkpoint.async_save failed: {type(error).__name__}: {error}",
                      RuntimeWarning, stacklevel=1)


def _wait_for_async_save() -> None:
    """Waits for the async_save in flight, if any (its error is the caller's of ``result()``)."""
    pending, _ASYNC["pending"] = _ASYNC["pending"], None
    if pending is not None:
        concurrent.futures.wait([pending])


def _commit(staging: str, path: str) -> None:
    old = None
    if os.path.exists(path):  # overwrite=True: move the old checkpoint aside until the new is in
        old = path + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(path, old)
    os.rename(staging, path)
    _fsync_dir(os.path.dirname(path))
    if old is not None:
        shutil.rmtree(old)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory; the rename stands anyway
        pass
    finally:
        os.close(fd)


def _check_complete(path: str) -> None:
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA_FILE)):
        return
    partial = path + PARTIAL_SUFFIX
    leftover = (f" {partial} exists: a save to this path was interrupted before it finished, "
                f"so it holds no usable checkpoint." if os.path.exists(partial) else "")
    if not os.path.exists(path):
        raise CheckpointNotFoundError(
            f"No checkpoint at {path}: the directory does not exist.{leftover} Check the path, "
            f"or load an earlier checkpoint.")
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(
            f"{path} is a file, not a checkpoint directory. A torch.save file loads with "
            f"torch.load; xshard.checkpoint.load reads directories written by "
            f"xshard.checkpoint.save or torch.distributed.checkpoint.save.")
    raise CheckpointNotFoundError(
        f"{path} is not a complete checkpoint: it has no {METADATA_FILE} file, which a save "
        f"writes last.{leftover} Load an earlier checkpoint.")


def load(state: dict, path) -> None:
    """Loads the checkpoint at ``path`` into ``state`` in place, in the state's current sharding.

    Call on every process. The checkpoint may have been saved on any mesh, sharding or number of
    processes: each process reads only the saved chunks overlapping the blocks its devices hold, and
    each tensor keeps its storage and sharding annotation. Every key, global shape and dtype is
    checked before anything is read; values are written into the state only after all reads
    succeeded, so a failed load leaves ``state`` unchanged.

    Args:
        state: the same structure as saved (a subset of its top-level keys is fine). Tensors are
            overwritten in place; Python values are replaced in their dicts; a module's tensors are
            overwritten in place; an optimizer gets its state created if it has none
            (``prime_optimizer``), overwritten, and ``load_state_dict`` for its hyperparameters
            (a parameter the checkpoint holds no state for, one that had no gradient yet when it
            was saved, is left without state, as ``load_state_dict`` leaves it); any other
            object with ``state_dict`` / ``load_state_dict`` gets ``load_state_dict``.
        path: a checkpoint directory.

    Raises:
        CheckpointNotFoundError: no directory at ``path``, or one without ``.metadata`` (an
            unfinished save).
        CheckpointError: a key of ``state`` is missing from the checkpoint, has another global shape
            or dtype, or is a tensor on one side only; or the checkpoint holds entries under a
            top-level key that ``state`` lacks (e.g. an optimizer that was not primed).

    Example:
        >>> import xshard.checkpoint as xcp
        >>> state = {"model": model, "optim": opt, "step": 0}
        >>> xcp.load(state, "ckpt/100")  # doctest: +SKIP
        >>> step = state["step"]  # doctest: +SKIP
    """
    _wait_for_async_save()
    path = os.path.abspath(os.fspath(path))
    _check_complete(path)
    check_process_group()
    targets = states.to_state_dicts(state, prime=True)
    states.match_saved_state(state, targets, FileSystemReader(path).read_metadata())
    planner = LoadPlanner(defer_writes=True)
    with _dcp_errors(f"Loading {path}", "nothing was written into the state"):
        dcp.load(targets, storage_reader=FileSystemReader(path), planner=planner)
    loaded = planner.apply()
    states.write_back(state, {key: loaded[key] for key in targets})
