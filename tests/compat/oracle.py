"""Eager CPU simulation of PyTorch/XLA's multi-process data parallel for scripts/mp_cnn.py.

Each replica is its own CPU model with its own BatchNorm statistics and dropout masks, trained on
its own ``DistributedSampler`` shard; after each backward the gradients are averaged (summed in
replica order, then multiplied by 1/world as ``xm.all_reduce(REDUCE_SUM, scale=1/world)`` does) and
every replica steps its own optimizer. The random draws of the script's processes are replayed in
the same order (each process seeds the CPU generator alike and draws only to initialise the model
and to start its loaders).

Dropout masks are the one thing CPU torch cannot reproduce: they come from xshard's device random
stream (a threefry key per op). ``dropout_masks`` draws them on xshard from the same seed and
position each replica starts from (``xm.set_rng_state(seed + index)``), applied to a tensor of ones;
everything else runs on CPU.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.multihost.conftest import ROOT

SCRIPTS = ROOT / "tests" / "compat" / "scripts"


@contextlib.contextmanager
def _torch_xla_names():
    from xshard.compat import hook

    hook.install()
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield
    finally:
        sys.path.remove(str(SCRIPTS))
        hook.uninstall()


def load_script():
    """The mp_cnn module (its imports of torch_xla resolved through the hook while importing)."""
    with _torch_xla_names():
        import mp_cnn
    return mp_cnn


def dropout_masks(seed: int, steps: int, shape: tuple, p: float) -> list[torch.Tensor]:
    """The scaled masks (0 or 1/(1-p)) of ``steps`` dropout calls on xshard after seeding its
    device stream with ``seed``; the stream's state is restored afterwards."""
    import xshard
    from xshard.compat import xla_model as xm

    saved = xm.get_rng_state()
    try:
        xm.set_rng_state(seed)
        ones = torch.ones(shape)
        return [F.dropout(ones.to(xshard.device()), p, training=True).cpu() for _ in range(steps)]
    finally:
        xm.set_rng_state(saved)


class _Mask(nn.Module):
    def __init__(self):
        super().__init__()
        self.mask = None

    def forward(self, x):
        return x * self.mask if self.training else x


def simulate(flags, world: int) -> dict:
    """Runs the script's training on CPU for ``world`` replicas; returns per-replica losses,
    accuracies and final state dicts."""
    script = load_script()
    loaders, models, optimizers = [], [], []
    for r in range(world):
        torch.manual_seed(flags.seed)
        train = script.synthetic_dataset(flags.train_samples, 100)
        test = script.synthetic_dataset(flags.test_samples, 200)
        sampler = test_sampler = None
        if world > 1:
            sampler = torch.utils.data.distributed.DistributedSampler(
                train, num_replicas=world, rank=r, shuffle=True)
            test_sampler = torch.utils.data.distributed.DistributedSampler(
                test, num_replicas=world, rank=r, shuffle=False)
        train_loader = torch.utils.data.DataLoader(
            train, batch_size=flags.batch_size, sampler=sampler, drop_last=True,
            shuffle=False if sampler else True)
        test_loader = torch.utils.data.DataLoader(
            test, batch_size=flags.batch_size, sampler=test_sampler, drop_last=True)
        model = script.Net()
        model.dropout = _Mask()
        models.append(model)
        optimizers.append(torch.optim.SGD(model.parameters(), lr=flags.lr * world,
                                          momentum=flags.momentum))
        loaders.append((sampler, train_loader, test_loader))
    steps = flags.num_epochs * len(loaders[0][1])
    masks = [dropout_masks(flags.seed + r, steps, (flags.batch_size, 16), 0.25)
             for r in range(world)]
    losses = [[] for _ in range(world)]
    step = 0
    for epoch in range(1, flags.num_epochs + 1):
        for sampler, _, _ in loaders:
            if sampler is not None:
                sampler.set_epoch(epoch)
        for batches in zip(*(train_loader for _, train_loader, _ in loaders)):
            for r, (data, target) in enumerate(batches):
                models[r].train()
                models[r].dropout.mask = masks[r][step]
                optimizers[r].zero_grad()
                loss = F.nll_loss(models[r](data), target)
                loss.backward()
                losses[r].append(loss.item())
            params = [list(m.parameters()) for m in models]
            for i in range(len(params[0])):
                total = params[0][i].grad.clone()
                for r in range(1, world):
                    total = total + params[r][i].grad
                average = total * (1.0 / world) if world > 1 else total
                for r in range(world):
                    params[r][i].grad = average.clone()
            for opt in optimizers:
                opt.step()
            step += 1
    accuracies = []
    for r in range(world):
        models[r].eval()
        correct = total = 0
        with torch.no_grad():
            for data, target in loaders[r][2]:
                pred = models[r](data).max(1, keepdim=True)[1]
                correct += int(pred.eq(target.view_as(pred)).sum())
                total += data.shape[0]
        accuracies.append(100.0 * correct / total)
    states = [{k: v for k, v in m.state_dict().items() if not k.startswith("dropout")}
              for m in models]
    return {"losses": losses, "accuracies": accuracies,
            "accuracy_mean": float(np.mean(accuracies)), "states": states}
