"""A ResNet-50-style conv net in plain PyTorch (no torchvision): a 7x7 stem, max-pool, four stages of
bottleneck blocks (1x1 -> 3x3 -> 1x1 convolutions with BatchNorm, a projected shortcut where the shape
changes), global average pooling and a linear classifier.

``ResNetConfig()`` is ResNet-50 (depths 3-4-6-3, widths 64-128-256-512, expansion 4: 25.6 M
parameters); smaller depths and widths give test-sized nets.

Example:
    >>> model = ResNet(ResNetConfig(depths=(1, 1), widths=(8, 16), num_classes=10))
    >>> logits = model(torch.randn(2, 3, 32, 32))  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ResNetConfig:
    depths: tuple = (3, 4, 6, 3)
    widths: tuple = (64, 128, 256, 512)
    expansion: int = 4
    stem_width: int = 64
    in_channels: int = 3
    num_classes: int = 1000

    def __post_init__(self):
        if len(self.depths) != len(self.widths) or not self.depths:
            raise ValueError(f"depths {self.depths} and widths {self.widths} must be non-empty and "
                             f"of the same length (one entry per stage).")
        if any(d < 1 for d in self.depths) or any(w < 1 for w in self.widths):
            raise ValueError(f"depths {self.depths} and widths {self.widths} must be positive.")


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (carries the stride) -> 1x1 expand, each with BatchNorm; ReLU after the sum."""

    def __init__(self, in_ch: int, width: int, stride: int, expansion: int):
        super().__init__()
        out_ch = width * expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.shortcut = None
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_ch))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.shortcut is None else self.shortcut(x)))


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig = ResNetConfig()):
        super().__init__()
        self.cfg = cfg
        self.stem = nn.Sequential(
            nn.Conv2d(cfg.in_channels, cfg.stem_width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(cfg.stem_width), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        blocks, in_ch = [], cfg.stem_width
        for stage, (depth, width) in enumerate(zip(cfg.depths, cfg.widths)):
            for i in range(depth):
                stride = 2 if (i == 0 and stage > 0) else 1
                blocks.append(Bottleneck(in_ch, width, stride, cfg.expansion))
                in_ch = width * cfg.expansion
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(in_ch, cfg.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x, targets=None):
        x = self.blocks(self.stem(x))
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)


def num_params(cfg: ResNetConfig) -> int:
    """Parameter count of ``ResNet(cfg)`` (BatchNorm affine weights included, running stats not)."""
    with torch.device("meta"):
        return sum(p.numel() for p in ResNet(cfg).parameters())
