"""Starts xshard.checkpoint.save and kills the process part-way, as a crash or preemption would.

Usage: interrupted_save.py PATH WHEN, WHEN one of
  after_data     every data file written, .metadata not yet (os._exit from the storage writer)
  before_rename  the whole checkpoint written in PATH.partial, not yet renamed to PATH
Exits with status 17 at that point; reaching the end would be a failure (status 0).
"""

import os
import sys

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemWriter

import xshard
import xshard.checkpoint as xcp
import xshard.spmd as xs
from xshard.checkpoint import api as checkpoint_api

KILLED = 17


def main() -> int:
    path, when = sys.argv[1], sys.argv[2]
    w = torch.arange(64.0).reshape(8, 8).to(xshard.device())
    xs.mark_sharding(w, xs.Mesh(np.arange(xshard.device_count()), (xshard.device_count(),),
                                ("x",)), ("x", None))
    if when == "after_data":
        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write_data(self, plan, planner).wait()
            os._exit(KILLED)

        FileSystemWriter.write_data = write_then_die
    elif when == "before_rename":
        checkpoint_api._commit = lambda staging, final: os._exit(KILLED)
    else:
        raise SystemExit(f"unknown WHEN {when!r}; choose after_data or before_rename")
    xcp.save({"w": w, "step": 3}, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
