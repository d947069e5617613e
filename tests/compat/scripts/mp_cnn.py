"""A PyTorch/XLA multi-process training script in the classic Kaggle style (torch_xla 1.x era):
``xmp.spawn``, a ``DistributedSampler`` from ``xrt_world_size()`` / ``get_ordinal()``,
``ParallelLoader(...).per_device_loader``, ``xm.optimizer_step``, step closures, ``mesh_reduce``,
``master_print`` and ``xm.save``. A small CNN with BatchNorm and dropout on synthetic data.

The tests run it unchanged: ``python -m xshard.compat mp_cnn.py --num_cores 2 --out DIR``. Beyond
what such a script does, it writes each replica's final state (``replica<i>.pt``) and prints one
``RESULT {json}`` line per replica for the test to read.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_xla  # noqa: F401
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.debug.metrics as met
import torch_xla.debug.profiler as xp
import torch_xla.distributed.xla_multiprocessing as xmp


def parse_flags(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--num_cores", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--train_samples", type=int, default=32)
    parser.add_argument("--test_samples", type=int, default=16)
    parser.add_argument("--log_steps", type=int, default=1)
    parser.add_argument("--out", default=".")
    return parser.parse_args(argv)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 8, kernel_size=3)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(32, 16)
        self.dropout = nn.Dropout(0.25)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.bn1(self.conv1(x)), 2))   # 4 x 4 x 4
        x = F.relu(self.bn2(self.conv2(x)))                     # 8 x 2 x 2
        x = torch.flatten(x, 1)
        x = self.dropout(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_dataset(n, seed):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 1, 8, 8, generator=generator)
    labels = torch.randint(0, 10, (n,), generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


def train_cnn(flags, index):
    torch.manual_seed(flags.seed)
    xm.set_rng_state(flags.seed + index)  # per-replica dropout masks

    train_dataset = synthetic_dataset(flags.train_samples, 100)
    test_dataset = synthetic_dataset(flags.test_samples, 200)
    train_sampler = None
    if xm.xrt_world_size() > 1:
        train_sampler = torch.utils.data.distributed.DistributedSampler(
            train_dataset, num_replicas=xm.xrt_world_size(), rank=xm.get_ordinal(), shuffle=True)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=flags.batch_size, sampler=train_sampler, drop_last=True,
        shuffle=False if train_sampler else True)
    test_sampler = None
    if xm.xrt_world_size() > 1:
        test_sampler = torch.utils.data.distributed.DistributedSampler(
            test_dataset, num_replicas=xm.xrt_world_size(), rank=xm.get_ordinal(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=flags.batch_size, sampler=test_sampler, drop_last=True)

    lr = flags.lr * xm.xrt_world_size()
    device = xm.xla_device()
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=flags.momentum)
    loss_fn = nn.NLLLoss()
    losses = []

    def _train_update(step, loss, tracker, epoch):
        losses.append(loss.item())
        tracker.rate()

    def train_loop_fn(loader, epoch):
        tracker = xm.RateTracker()
        model.train()
        for step, (data, target) in enumerate(loader):
            with xp.StepTrace("train_loop", step_num=step):
                with xp.Trace("build_graph"):
                    optimizer.zero_grad()
                    output = model(data)
                    loss = loss_fn(output, target)
                    loss.backward()
                xm.optimizer_step(optimizer)
            tracker.add(flags.batch_size)
            if step % flags.log_steps == 0:
                xm.add_step_closure(_train_update, args=(step, loss, tracker, epoch))

    def test_loop_fn(loader):
        total_samples = 0
        correct = 0
        model.eval()
        for data, target in loader:
            output = model(data)
            pred = output.max(1, keepdim=True)[1]
            correct += pred.eq(target.view_as(pred)).sum()
            total_samples += data.size()[0]
        return 100.0 * correct.item() / total_samples

    lengths = []
    for epoch in range(1, flags.num_epochs + 1):
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        para_loader = pl.ParallelLoader(train_loader, [device])
        per_device = para_loader.per_device_loader(device)
        lengths.append(len(per_device))
        train_loop_fn(per_device, epoch)
        xm.master_print(f"Finished training epoch {epoch}")

    accuracy = test_loop_fn(pl.MpDeviceLoader(test_loader, device))
    accuracy_mean = xm.mesh_reduce("test_accuracy", accuracy, np.mean)
    xm.master_print(f"Accuracy: {accuracy_mean:.2f}")
    xm.master_print(met.short_metrics_report())

    xm.save(model.state_dict(), os.path.join(flags.out, "model.pt"))
    torch.save({k: v.cpu() for k, v in model.state_dict().items()},
               os.path.join(flags.out, f"replica{index}.pt"))
    result = {"index": index, "world": xm.xrt_world_size(), "ordinal": xm.get_ordinal(),
              "master": xm.is_master_ordinal(), "losses": losses, "accuracy": accuracy,
              "accuracy_mean": accuracy_mean, "lengths": lengths,
              "compiles": met.metric_data("CompileTime")[0], "metrics": met.metric_names()}
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


def _mp_fn(index, flags):
    torch.set_default_dtype(torch.float32)
    train_cnn(flags, index)


if __name__ == "__main__":
    FLAGS = parse_flags()
    xmp.spawn(_mp_fn, args=(FLAGS,), nprocs=FLAGS.num_cores)
