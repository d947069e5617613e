"""Spatial partitioning: a conv net whose input images are split along their height, checked
against eager CPU PyTorch.

Large images (segmentation, medical volumes) may not fit one device even at batch 1. Sharding the
spatial dimensions splits every activation the same way; each 3x3 convolution then needs a one-row
halo from its neighbours, which XLA's partitioner fetches with collective-permutes. The 8 devices
form a (2, 4) mesh ('data', 'spatial'): the batch is split in 2, each image's height in 4.

Run:  XSHARD_CPU_DEVICES=8 python examples/spatial_partitioning.py
"""

import copy
import re
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import xshard
import xshard.spmd as xs

STEPS = 5


class ConvNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        return self.head(x.mean(dim=(2, 3)))


def batches(n: int):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        yield torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def main() -> int:
    torch.manual_seed(0)
    mesh = xs.Mesh(np.arange(8), (2, 4), ("data", "spatial"))
    reference = ConvNet()
    model = copy.deepcopy(reference).to(xshard.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)

    # (N, C, H, W): batch over 'data', height over 'spatial'; labels over 'data'.
    loader = xs.MpDeviceLoader(batches(STEPS), xshard.device(), input_sharding=(
        xs.ShardingSpec(mesh, ("data", None, "spatial", None))))
    worst = 0.0
    for step, ((x, y), (ref_x, ref_y)) in enumerate(zip(loader, batches(STEPS))):
        if step == 0:
            print(f"input {tuple(x.shape)} sharding: {xs.get_sharding_spec(x)}")
        loss = F.cross_entropy(model(x), y)
        if step == 0:
            hlo = xshard.debug.compiled_hlo_text([loss])
            halos = len(re.findall(r"= \S+ collective-permute\(", hlo))
            print(f"collective-permutes (halo exchanges) in the partitioned forward: {halos}")
        loss.backward()
        opt.step()
        opt.zero_grad()
        xshard.sync()

        ref_loss = F.cross_entropy(reference(ref_x), ref_y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, abs(loss.item() - ref_loss.item()))
        print(f"step {step}: loss {loss.item():.5f}  (eager CPU {ref_loss.item():.5f})")

    param_diff = max((p.cpu() - r.detach()).abs().max().item()
                     for p, r in zip(model.parameters(), reference.parameters()))
    print(f"compiles: {xshard.metrics.snapshot()['compiles']}")
    print(f"max |loss - CPU loss| = {worst:.2e}, max |param - CPU param| = {param_diff:.2e}")
    if worst > 1e-3 or param_diff > 1e-3:
        print("MISMATCH against eager CPU PyTorch", file=sys.stderr)
        return 1
    print("OK: the spatially partitioned run matches eager CPU PyTorch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
