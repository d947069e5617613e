"""Replicas that go wrong, one way per run: python -m xshard.compat replica_fail.py MODE

- raise:  replica 1 raises before the gradient all-reduce; replica 0 waits in it;
- shapes: the replicas all-reduce tensors of different shapes;
- skip:   replica 1 returns without the all-reduce replica 0 makes;
- tags:   the replicas meet at rendezvous with different tags;
- save:   the master alone calls xm.save (which meets the others), replica 1 returns.
"""

import os
import sys

import torch

import torch_xla.core.xla_model as xm
import torch_xla.distributed.xla_multiprocessing as xmp


def _mp_fn(index, mode):
    dev = xm.xla_device()
    t = torch.ones(4).to(dev)
    xm.all_reduce(xm.REDUCE_SUM, t)  # once together: every replica is up
    if mode == "raise" and index == 1:
        raise ValueError("replica 1 fails on purpose")
    if mode == "shapes":
        t = torch.ones(4 + index).to(dev)
    if mode == "skip" and index == 1:
        return
    if mode == "save":
        if xm.is_master_ordinal():
            xm.save({"t": t}, os.devnull)
        return
    if mode == "tags":
        xm.rendezvous(f"tag {index}")
    else:
        xm.all_reduce(xm.REDUCE_SUM, t)
    print("survived", flush=True)


if __name__ == "__main__":
    try:
        xmp.spawn(_mp_fn, args=(sys.argv[1],), nprocs=2)
    except xmp.SpawnError as e:
        print(f"SPAWN ERROR rank={e.failed_rank} code={e.exit_code}: {e}", flush=True)
        sys.exit(3)
