"""CIFAR-style ResNets (METHODS.md §2): a 3x3 stride-1 stem without max-pool, four stages of basic blocks (64, 128,
256, 512 channels; stride 2 from the second), global average pooling; the feature is 512-d.

``blocks``: ResNet-10 [1,1,1,1], ResNet-12 [2,1,1,1], ResNet-18 [2,2,2,2], ResNet-34 [3,4,6,3]. ``norm``:
``group`` (GroupNorm with ``groups`` groups: no running statistics, so many clients train vectorized) or
``batch`` (BatchNorm: per-client running statistics, the sequential path). Both have the same parameters.
``width`` scales every stage's channels (1: the published network; 0.25: a 16-wide one for CPU runs), the feature
is ``512 * width``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import FedModel

BLOCKS = {"resnet10": [1, 1, 1, 1], "resnet12": [2, 1, 1, 1], "resnet18": [2, 2, 2, 2], "resnet34": [3, 4, 6, 3]}


def norm_layer(kind: str, channels: int, groups: int) -> nn.Module:
    """BatchNorm, or GroupNorm with ``groups`` groups (fewer where ``channels`` is not a multiple)."""
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(math.gcd(groups, channels), channels)
    raise ValueError(f"norm: must be 'group' or 'batch' (got {kind!r})")


def check_width(width) -> float:
    if isinstance(width, bool) or not isinstance(width, (int, float)) or not 0 < width <= 8:
        raise ValueError(f"width: must be a number in (0, 8] (got {width!r})")
    return float(width)


def check_images(input_shape) -> None:
    if len(input_shape) != 3:
        raise ValueError(f"needs images (C, H, W), got inputs of shape {tuple(input_shape)}")


def scaled(channels: int, width: float, multiple: int = 2) -> int:
    """``channels * width`` rounded to a multiple of ``multiple`` (at least ``multiple``)."""
    return max(multiple, int(round(channels * width / multiple)) * multiple)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, norm: str, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = norm_layer(norm, c_out, groups)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = norm_layer(norm, c_out, groups)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), norm_layer(norm, c_out, groups))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(FedModel):
    def __init__(self, input_shape, num_classes, blocks, norm: str = "group", groups: int = 2, width: float = 1.0):
        super().__init__()
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or 64 % groups:
            raise ValueError(f"groups: must divide 64 (got {groups!r})")
        check_images(input_shape)
        w = check_width(width)
        widths = [scaled(c, w) for c in (64, 128, 256, 512)]
        c_in, c0 = input_shape[0], widths[0]
        self.conv1 = nn.Conv2d(c_in, c0, 3, 1, 1, bias=False)
        self.bn1 = norm_layer(norm, c0, groups)
        stages, c = [], c0
        for i, (width, n) in enumerate(zip(widths, blocks, strict=True)):
            layers = []
            for j in range(n):
                layers.append(BasicBlock(c, width, 2 if (i > 0 and j == 0) else 1, norm, groups))
                c = width
            stages.append(nn.Sequential(*layers))
        self.layers = nn.Sequential(*stages)
        self.linear = nn.Linear(c, num_classes)
        self.feature_dim, self.num_classes = c, num_classes

    def features(self, x):
        out = self.layers(torch.relu(self.bn1(self.conv1(x))))
        return out.mean((2, 3))

    def head(self, z):
        return self.linear(z)


def _factory(name: str):
    def build(input_shape, num_classes, norm: str = "group", groups: int = 2, width: float = 1.0):
        return ResNet(input_shape, num_classes, BLOCKS[name], norm, groups, width)

    build.__name__ = name
    build.__doc__ = (f"CIFAR-style {name.replace('resnet', 'ResNet-')} {BLOCKS[name]} (3x3 stem, no max-pool, "
                     "feature 512); norm: group (GroupNorm, vectorizes) or batch (BatchNorm)")
    return build


RESNETS = {name: _factory(name) for name in BLOCKS}
