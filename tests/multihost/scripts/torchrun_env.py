"""Started as torchrun starts processes (RANK, WORLD_SIZE, MASTER_ADDR/PORT only)."""

import numpy as np
import torch

from common import report, start

import xshard  # noqa: E402
import xshard.spmd as xs  # noqa: E402


def main():
    torch.manual_seed(0)  # before initialize(): the device stream is keyed at first use
    rank, world = start()
    x = torch.arange(16.0).reshape(8, 2).to(xshard.device())
    xs.mark_sharding(x, xs.Mesh(np.arange(8), (8,), ("x",)), ("x", None))
    report(rank=rank, world=world, total=(x * 2).cpu().sum().item(),
           devices=xshard.device_count())


if __name__ == "__main__":
    main()
