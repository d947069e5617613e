"""2 processes: process 1 raises; process 0 waits at a sync. The run must end at once.

argv[1]: 'raise' (an uncaught exception on process 1) or 'exit' (os._exit(3) on process 1).
"""

import os
import sys
import time

import torch

from common import start

import xshard  # noqa: E402


def main(mode: str):
    rank, world = start()
    x = torch.ones(4, device=xshard.device())
    x.sum().item()
    if rank == 1:
        print(f"FAILING_AT {time.time():.3f}", flush=True)
        if mode == "exit":
            os._exit(3)
        raise ValueError("boom on process 1")
    (x * 2).sum().item()  # process 0 waits here for process 1, which has failed
    time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1])
