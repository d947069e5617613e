"""2 processes: FSDP state dicts and initial parameters across processes.

Checks against eager CPU torch (the same model and step on CPU) and across processes.
"""

import numpy as np
import torch
import torch.distributed as dist

from common import report, start

import xshard  # noqa: E402
import xshard.spmd as xs  # noqa: E402
from xshard.fsdp import FSDP, IncompleteShardsError, ShardedEntry, to_full  # noqa: E402
from xshard.models.gpt import GPT, GPTConfig  # noqa: E402

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)


def step(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x, y).backward()
    opt.step()


def close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def main():
    rank, world = start()
    dev = xshard.device()
    mesh = xs.Mesh(np.arange(8), (8,), ("fsdp",))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, TINY.vocab_size, (8, TINY.block_size), generator=g)
    y = torch.randint(0, TINY.vocab_size, (8, TINY.block_size), generator=g)

    torch.manual_seed(0)
    reference = GPT(TINY)
    torch.manual_seed(0)
    model = FSDP(GPT(TINY), mesh=mesh)
    step(reference, x, y)
    step(model, x.to(dev), y.to(dev))
    xshard.sync()
    expected = {k: v.detach() for k, v in reference.state_dict().items()}
    out = {"rank": rank}

    full = model.state_dict()  # every process gathers every tensor
    out["full_matches_cpu"] = close(full, expected)
    only0 = model.state_dict(rank0_only=True)
    out["rank0_only_keys"] = len(only0)
    out["rank0_only_matches"] = close(only0, expected) if rank == 0 else None

    sharded = model.sharded_state_dict()
    entry = sharded["wte.weight"]
    out["sharded_entry"] = [type(entry).__name__, entry.process_index, entry.complete,
                            entry.covered, int(np.prod(entry.global_shape))]
    out["incomplete"] = sum(isinstance(v, ShardedEntry) and not v.complete
                            for v in sharded.values())
    try:
        to_full(sharded)
        out["to_full_error"] = None
    except IncompleteShardsError as e:
        out["to_full_error"] = str(e)

    # A full state dict loads back (every process holds it all).
    model.load_state_dict(full)
    out["reload_matches"] = close(model.state_dict(), expected)

    # Per-process initial values: sync_module_states copies process 0's.
    torch.manual_seed(100 + rank)
    differing = GPT(TINY)
    mine = {k: v.detach().clone() for k, v in differing.state_dict().items()}
    ref0 = [mine]
    dist.broadcast_object_list(ref0, src=0)
    synced = FSDP(differing, mesh=mesh, sync_module_states=True)
    out["synced_matches_process0"] = close(synced.state_dict(), ref0[0])
    report(**out)


if __name__ == "__main__":
    main()
