"""Distributed checkpoints: each process saves its own shards; a checkpoint loads onto any mesh.

The format is PyTorch's ``torch.distributed.checkpoint`` (DCP): a directory with one data file per
process and a ``.metadata`` file. ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``
turns it into one ``torch.save`` file that plain PyTorch reads.

Public API:

* ``save(state, path)`` / ``load(state, path)``: nested dicts of tensors, state dicts, modules
  (FSDP included), optimizers and Python values; atomic save, all-or-nothing load.
* ``async_save(state, path)``: ``save`` that returns once the state is on the host.
* ``SavePlanner()`` / ``LoadPlanner()``: the same, through ``dcp.save`` / ``dcp.load`` directly.
* ``prime_optimizer(opt)``: gives an optimizer that has not stepped the state to load into.
* ``CheckpointError``, ``CheckpointNotFoundError``.

Example:
    >>> import xshard.checkpoint as xcp
    >>> xcp.save({"model": model, "optim": opt, "step": step}, "ckpt/step_100")  # doctest: +SKIP
    >>> state = {"model": model, "optim": opt, "step": 0}
    >>> xcp.load(state, "ckpt/step_100")   # resharded to the model's current layout  # doctest: +SKIP

Module order: errors <- layout <- planner <- state <- api.
"""

from xshard.checkpoint.api import async_save, load, save
from xshard.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from xshard.checkpoint.planner import LoadPlanner, SavePlanner
from xshard.checkpoint.state import prime_optimizer

__all__ = ["save", "async_save", "load", "SavePlanner", "LoadPlanner", "prime_optimizer", "CheckpointError",
           "CheckpointNotFoundError"]
