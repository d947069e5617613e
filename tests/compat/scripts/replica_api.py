"""Each xm / xr / pl name inside 2 replicas of xmp.spawn; every replica prints one RESULT line.

Run: python -m xshard.compat replica_api.py OUT_DIR
"""

import json
import os
import sys

import torch

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.xla_multiprocessing as xmp
import torch_xla.runtime as xr
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def _mp_fn(index, out_dir):
    import xshard
    from xshard.core import runtime

    dev = xm.xla_device()
    r = index + 1
    out = {
        "index": index, "device": str(dev), "torch_xla_device": str(torch_xla.device()),
        "world": [xm.xrt_world_size(), xr.world_size()],
        "ordinal": [xm.get_ordinal(), xr.global_ordinal(), xm.get_local_ordinal(),
                    xr.local_ordinal(), xr.process_index(), xr.process_count()],
        "master": [xm.is_master_ordinal(), xm.is_master_ordinal(local=False)],
        "devices": [xr.global_runtime_device_count(), xr.addressable_runtime_device_count(),
                    xshard.device_count(), len(runtime.local_devices())],
        "device_type": xr.device_type(), "is_spmd": xr.is_spmd(),
    }
    # all_reduce: every reduce type, dtypes, a 0-dim tensor, a scale, a list in place.
    f = torch.tensor([1.0, -2.0, 3.0]) * r
    i = torch.tensor([5, 6, 7], dtype=torch.int64) * r
    b = torch.tensor([True, index == 0, False])
    reduced = {}
    for name in ("REDUCE_SUM", "REDUCE_MAX", "REDUCE_MIN", "REDUCE_MUL"):
        op = getattr(xm, name)
        reduced[name] = [xm.all_reduce(op, f.to(dev)).cpu().tolist(),
                         xm.all_reduce(op, i.to(dev)).cpu().tolist()]
    for name in ("REDUCE_AND", "REDUCE_OR"):
        reduced[name] = [xm.all_reduce(getattr(xm, name), b.to(dev)).cpu().tolist(),
                         xm.all_reduce(getattr(xm, name), i.to(dev)).cpu().tolist()]
    reduced["scaled"] = xm.all_reduce(xm.REDUCE_SUM, f.to(dev), scale=0.5).cpu().tolist()
    reduced["scalar"] = xm.all_reduce(xm.REDUCE_SUM, torch.tensor(2.5 * r).to(dev)).item()
    # small tensors of two dtypes (bucketed per dtype) and a large one (an operand of its own)
    in_place = [torch.full((2, 2), float(r)).to(dev), torch.arange(3).to(dev) * r,
                torch.tensor(float(r)).to(dev), torch.full((256, 257), float(r)).to(dev)]
    returned = xm.all_reduce(xm.REDUCE_SUM, in_place, scale=1.0)
    large = in_place.pop()
    reduced["large"] = [list(large.shape), large.unique().cpu().tolist()]
    reduced["list"] = [returned is in_place] + [t.cpu().tolist() for t in in_place]
    out["all_reduce"] = reduced
    # all_gather along dims 0 and 1.
    g = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * index
    out["all_gather"] = [xm.all_gather(g.to(dev)).cpu().tolist(),
                         xm.all_gather(g.to(dev), dim=1).cpu().tolist()]
    # torch_xla's other spellings: a list (coalesced), groups=[] (every replica), a group listed
    # out of order for a reduction (any order), pin_layout as the 5th positional argument.
    out["all_gather_list"] = [t.cpu().tolist() for t in xm.all_gather(
        [g.to(dev), g[0].to(dev)], groups=[], pin_layout=False)]
    out["groups_any_order"] = [
        xm.all_reduce(xm.REDUCE_SUM, g.to(dev), 1.0, [[1, 0]], False).cpu().tolist(),
        xm.all_reduce(xm.REDUCE_SUM, g.to(dev), groups=[]).cpu().tolist()]
    # reduce_scatter (a tensor, a list with a dim per rank, other reductions, output=),
    # all_to_all, collective_permute (a swap, one pair: the other replica gets zeros), broadcast.
    a = torch.arange(8, dtype=torch.float32).reshape(4, 2) + 10 * index
    n = xm.xrt_world_size()
    out["reduce_scatter"] = {
        "sum": xm.reduce_scatter(xm.REDUCE_SUM, a.to(dev), 0.5, 0, n).cpu().tolist(),
        "list": [o.cpu().tolist() for o in xm.reduce_scatter(
            xm.REDUCE_SUM, [a.to(dev), torch.arange(6).to(dev) * r], 1.0, -1, n)],
        "max": xm.reduce_scatter(xm.REDUCE_MAX, (a * (1 - 2 * index)).to(dev), 1.0, 1,
                                 n).cpu().tolist(),
        "mul": xm.reduce_scatter(xm.REDUCE_MUL, a.long().to(dev), 1.0, 0, n).cpu().tolist(),
        "and": xm.reduce_scatter(xm.REDUCE_AND, torch.tensor([True, index == 0, True,
                                                              False]).to(dev), 1.0, 0,
                                 n).cpu().tolist(),
    }
    into = torch.zeros(4, 1).to(dev)
    xm.reduce_scatter(xm.REDUCE_MIN, a.to(dev), 1.0, 1, n, output=into)
    out["reduce_scatter"]["output"] = into.cpu().tolist()
    out["all_to_all"] = [xm.all_to_all(a.to(dev), 0, 1, n).cpu().tolist(),
                         xm.all_to_all(a.to(dev), 1, 0, n).cpu().tolist()]
    out["permute"] = [xm.collective_permute(a.to(dev), [[0, 1], [1, 0]]).cpu().tolist(),
                      xm.collective_permute(a.to(dev), [(0, 1)]).cpu().tolist(),
                      xm.collective_permute(torch.tensor(float(r)).to(dev), [[1, 0]]).item()]
    sent = [a.to(dev), torch.arange(3).to(dev) * r, torch.tensor(index == 1).to(dev)]
    xm.collective_broadcast(sent, root_ordinal=1)
    out["broadcast"] = [t.cpu().tolist() for t in sent]
    torch.manual_seed(index)  # each replica's own initialisation
    built = torch.nn.Linear(3, 2)
    built.register_buffer("count", torch.full((2,), float(index)))
    built = built.to(dev)
    out["own_param"] = built.weight.cpu().tolist()
    xm.broadcast_master_param(built)
    out["master_param"] = [built.weight.cpu().tolist(), built.count.cpu().tolist()]
    # Host exchanges.
    out["rendezvous"] = [p.decode() for p in xm.rendezvous("api", f"from {index}".encode())]
    out["mesh_reduce"] = xm.mesh_reduce("api", torch.tensor([float(r)]).to(dev),
                                        lambda xs: torch.cat(xs).tolist())
    # optimizer_step averages gradients: a linear model on per-replica data.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3) * r
    model(x.to(dev)).square().mean().backward()
    out["grad_before"] = model.weight.grad.cpu().tolist()
    xm.optimizer_step(opt, barrier=True)
    out["grad_after"] = model.weight.grad.cpu().tolist()
    out["weight"] = model.weight.detach().cpu().tolist()
    # The same step as one torch_xla.compile(full_graph=True): its all-reduce may run.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @torch_xla.compile(full_graph=True)
    def step(data):
        model(data).square().mean().backward()
        xm.optimizer_step(opt)

    step(x.to(dev))
    out["compiled_weight"] = model.weight.detach().cpu().tolist()
    # The loaders sync before each batch and run step closures.
    seen = []
    loader = pl.MpDeviceLoader([torch.ones(2) * k for k in range(3)], dev)
    for k, batch in enumerate(loader):
        xm.add_step_closure(lambda t, k=k: seen.append([k, t.cpu().tolist()]), args=(batch * 2,))
    out["closures"] = seen
    out["loader_len"] = len(loader)
    # xm.save: written once; rng state; names that have no meaning in a replica.
    xm.save({"w": model.weight, "step": 1, "nested": [torch.ones(2).to(dev) * r]},
            os.path.join(out_dir, "saved.pt"))
    xm.set_rng_state(77 + index)
    out["rng"] = [xm.get_rng_state(), torch.rand(3, device=dev).cpu().tolist()]
    out["errors"] = {
        "use_spmd": _error(xr.use_spmd),
        "fsdp": _error(lambda: XlaFullyShardedDataParallel(torch.nn.Linear(2, 2))),
        "spawn": _error(lambda: xmp.spawn(_mp_fn, args=(out_dir,), nprocs=2)),
        "device_1": _error(lambda: xm.xla_device(1)),
        "groups": _error(lambda: xm.all_reduce(xm.REDUCE_SUM, f.to(dev), groups=[[0], [1]])),
        "group_order": _error(lambda: xm.all_gather(f.to(dev), groups=[[1, 0]])),
        "number": _error(lambda: xm.all_reduce(xm.REDUCE_SUM, 5.0)),
        "full_graph": _error(lambda: torch_xla.compile(lambda: f.to(dev).sum().item(),
                                                       full_graph=True)()),
    }
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    xmp.spawn(_mp_fn, args=(sys.argv[1],), nprocs=2)
