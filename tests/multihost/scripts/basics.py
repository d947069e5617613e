"""2 processes x 4 CPU devices: initialize, positions, uploads, reads, local shards, collectives."""

import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from common import report, start

import xshard  # noqa: E402
import xshard.spmd as xs  # noqa: E402
from xshard.core import runtime  # noqa: E402
from xshard.fsdp import FSDP  # noqa: E402


def main():
    rank, world = start()
    dev = xshard.device()
    out = {"rank": rank, "world": world, "local_device_count": xshard.local_device_count(),
           "is_main": xshard.is_main_process()}
    # torch.distributed: a gloo group, so DistributedSampler() needs no arguments.
    sampler = torch.utils.data.DistributedSampler(list(range(8)), shuffle=False)
    out["torch_dist"] = [dist.get_rank(), dist.get_world_size(), list(sampler)]
    out["jax_ids"] = [d.id for d in runtime.devices()]
    out["local_positions"] = [runtime.position(d) for d in runtime.local_devices()]

    # Replicated upload and a local read of a replicated result.
    host = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    x = host.to(dev)
    out["replicated_sum"] = (x * 2).sum().item()

    # Sharded over all 8 devices: the string names positions; reads gather.
    mesh = xs.Mesh(np.arange(8), (8,), ("x",))
    xs.mark_sharding(x, mesh, ("x", None))
    out["spec"] = xs.get_sharding_spec(x)
    y = x * 3 + 1
    xshard.sync()
    out["y_spec"] = xs.get_sharding_spec(y)
    out["read_ok"] = bool(torch.equal(y.cpu(), host * 3 + 1))
    out["print"] = str(y).splitlines()[0]
    gram = x.T @ x  # contraction over the sharded dimension: an all-reduce across processes
    out["gram_ok"] = bool(torch.allclose(gram.cpu(), host.T @ host))

    # Meshes listing devices out of order (HybridMesh's own order, a reversed mesh): a read
    # gathers in the value's own device order (it raised: the gather's devices were sorted).
    hybrid = xs.HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(1, 2), axis_names=("a", "b"))
    reversed_mesh = xs.Mesh(np.arange(8)[::-1].copy(), (2, 4), ("a", "b"))
    reads = []
    for m in (hybrid, reversed_mesh):
        w = host.to(dev)
        xs.mark_sharding(w, m, ("a", "b"))
        reads.append(bool(torch.equal((w * 2).cpu(), host * 2)))
    out["unordered_mesh_reads"] = [hybrid.device_ids.tolist(), *reads]

    # Local shards: this process's devices only, named and indexed by position.
    shards = xs.XLAShardedTensor.wrap(x).local_shards
    out["shards"] = [[s.shard_device, s.indices[0].start, s.indices[0].stop] for s in shards]
    for s in shards:
        s.data = s.data + 100 * (rank + 1)
    xs.XLAShardedTensor.wrap(x).load_local_shards_(shards)
    expected = host.clone()
    expected[:4] += 100
    expected[4:] += 200
    out["load_local_ok"] = bool(torch.equal(x.cpu(), expected))

    # A manual region: an all-reduce over the axis spanning both processes.
    with torch.no_grad():
        local = xs.enable_manual_sharding(x, ("x", None), mesh=mesh)
        local = xs.all_reduce(local, "x")
        z = xs.disable_manual_sharding(local, ("x", None), (8, 4), mesh=mesh)
    out["manual_ok"] = bool(torch.equal(z.cpu(), expected.reshape(8, 1, 4).sum(0).repeat(8, 1)))

    # The device random stream starts from the seed the processes agreed on.
    r = torch.rand(4, device=dev).cpu()
    gathered = [None] * world
    dist.all_gather_object(gathered, r.tolist())
    out["rng_agree"] = all(g == gathered[0] for g in gathered)

    # FSDP on a sub-mesh spanning both processes: default-placed inputs are copied onto its
    # devices from the local replica (no cross-host device_put).
    torch.manual_seed(0)
    reference = torch.nn.Linear(8, 8)
    torch.manual_seed(0)
    layer = FSDP(torch.nn.Linear(8, 8), mesh=xs.Mesh(np.array([0, 1, 4, 5]), (4,), ("fsdp",)))
    inputs = torch.arange(32, dtype=torch.float32).reshape(4, 8) / 10
    got = layer(inputs.to(dev)).square().sum().item()
    want = reference(inputs).square().sum().item()
    out["submesh_ok"] = abs(got - want) <= 1e-4 * abs(want)

    # The classic API's one program over both processes: xm.save writes from process 0 and the
    # processes meet after it, as they do at xm.rendezvous (each went on alone: process 1 read
    # the file before process 0 had written it).
    from xshard.compat import xla_model as xm

    path = os.path.join(sys.argv[1], "xm_save.pt")
    if rank == 1:
        time.sleep(0.5)  # would read first without the meeting
    xm.save({"step": 2, "w": x}, path)
    saved = torch.load(path)
    out["xm_save_ok"] = saved["step"] == 2 and bool(torch.equal(saved["w"], expected))
    flag = path + ".flag"
    if rank == 0:
        time.sleep(0.5)
        with open(flag, "w") as f:
            f.write("done")
    xm.rendezvous("flag written")
    out["rendezvous_ok"] = os.path.exists(flag)

    # Memory figures: local devices, by position.
    out["memory_keys"] = sorted(xshard.memory.live_bytes_per_device())

    # Upload timings (replicated, 256x256 float32): no collective per upload.
    data = torch.randn(256, 256)
    start_t = time.perf_counter()
    for _ in range(20):
        data.to(dev)
    out["upload_ms"] = (time.perf_counter() - start_t) / 20 * 1e3
    xshard.sync()
    report(**out)


if __name__ == "__main__":
    main()
