"""2 processes: ways the processes diverge, each caught as an error on every process.

Each case catches its error, records (class, message, seconds to fail) and goes on; a failed check
raises before anything runs, so the processes stay in step for the next case. The timeout and exit
cases come last: they leave the processes out of step.
"""

import gc
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common import report, start

import xshard  # noqa: E402
import xshard.spmd as xs  # noqa: E402
from xshard.fsdp import FSDP  # noqa: E402
from xshard.models.gpt import GPT, GPTConfig  # noqa: E402

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)


def attempt(results, name, fn):
    begin = time.perf_counter()
    try:
        fn()
        results[name] = {"error": None, "seconds": time.perf_counter() - begin}
    except Exception as e:  # noqa: BLE001  (every case records what it raised)
        results[name] = {"error": type(e).__name__, "message": str(e),
                         "seconds": time.perf_counter() - begin}
    gc.collect()


def main():
    rank, world = start()
    dev = xshard.device()
    mesh = xs.Mesh(np.arange(8), (8,), ("x",))
    results = {}

    def garbage_on_one_process():
        x = torch.ones(8, 4, device=dev)
        xshard.sync()
        gc.disable()
        if rank == 0:  # a pending value kept alive only by a reference cycle
            holder = {}
            holder["self"] = holder
            holder["t"] = x * 5
            del holder
        y = x + 1
        gc.enable()
        return y.sum().item()

    def shapes_differ():
        x = torch.ones(8 + 8 * rank, 4, device=dev)
        xs.mark_sharding(x, mesh, ("x", None))
        return (x.T @ x).sum().item()

    def rank0_only_read():
        w = torch.ones(8, 4, device=dev)
        xs.mark_sharding(w, mesh, ("x", None))
        xshard.sync()
        loss = (w * 2).sum()
        if rank == 0:
            print("loss", loss.item())
        w2 = w + 1
        xshard.sync()
        return w2

    def unseeded_upload():
        layer = nn.Linear(4, 4).to(dev)
        return layer(torch.ones(2, 4, device=dev)).sum().item()

    def unseeded_fsdp():
        model = FSDP(GPT(TINY))
        return model

    def number_per_rank():  # in a program with multi-output nodes (cross_entropy's)
        x = torch.ones(4, 3, device=dev)
        y = torch.zeros(4, dtype=torch.long, device=dev)
        return F.cross_entropy(x * (1.0 + rank), y).item()

    def seeded_per_rank():
        torch.manual_seed(rank)
        return torch.rand(4, device=dev).sum().item()

    attempt(results, "garbage_on_one_process", garbage_on_one_process)
    attempt(results, "shapes_differ", shapes_differ)
    attempt(results, "rank0_only_read", rank0_only_read)
    attempt(results, "unseeded_upload", unseeded_upload)
    attempt(results, "unseeded_fsdp", unseeded_fsdp)
    torch.manual_seed(0)
    attempt(results, "seeded_alike_fsdp", lambda: FSDP(GPT(TINY)))
    attempt(results, "seeded_per_rank", seeded_per_rank)
    attempt(results, "number_per_rank", number_per_rank)
    torch.manual_seed(0)

    # Out of step from here: process 1 skips a sync, then exits while process 0 waits again.
    x = torch.ones(8, 4, device=dev)
    xshard.sync()
    if rank == 0:
        attempt(results, "skipped_sync", lambda: (x * 3).sum().item())
        attempt(results, "peer_exited", lambda: (x * 4).sum().item())
    else:
        time.sleep(float(__import__("os").environ["XSHARD_SYNC_TIMEOUT"]) + 2)
    report(rank=rank, results=results)


if __name__ == "__main__":
    main()
