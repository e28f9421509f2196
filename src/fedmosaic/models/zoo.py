"""The models of METHODS.md §2 (first set). Factories take ``(input_shape, num_classes, **options)``."""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import FedModel


def _flat_dim(shape: tuple[int, ...]) -> int:
    return int(math.prod(shape))


class LogisticRegression(FedModel):
    """Multinomial logistic regression; the "features" are the flattened input (identity body)."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.feature_dim = _flat_dim(input_shape)
        self.num_classes = num_classes
        self.linear = nn.Linear(self.feature_dim, num_classes)

    def features(self, x):
        return x.flatten(1)

    def head(self, z):
        return self.linear(z)


class LinearSVM(LogisticRegression):
    """Same parameters as logistic regression; the hinge loss is the task config's (``model.task_loss: hinge``); the
    paper's 0.01||W||^2 is left out (docs/design.md, Deviations: APFL-PD)."""


class MLP(FedModel):
    """784-100-C "2-layer DNN" (pFedSRB) by default; ``hidden`` may list several layers. The last hidden layer is
    the feature."""

    def __init__(self, input_shape, num_classes, hidden: int | list[int] = 100):
        super().__init__()
        widths = [hidden] if type(hidden) is int else hidden
        if not isinstance(widths, list) or not widths or not all(type(h) is int and h >= 1 for h in widths):
            raise ValueError(f"hidden: must be a width >= 1 or a non-empty list of them (got {hidden!r})")
        sizes = [_flat_dim(input_shape), *widths]
        self.body = nn.Sequential(*(m for a, b in zip(sizes, sizes[1:]) for m in (nn.Linear(a, b), nn.ReLU())))
        self.feature_dim = sizes[-1]
        self.num_classes = num_classes
        self.fc = nn.Linear(sizes[-1], num_classes)

    def features(self, x):
        return self.body(x.flatten(1))

    def head(self, z):
        return self.fc(z)


class _ConvNet(FedModel):
    """Two conv+ReLU+maxpool blocks, one hidden FC layer (the feature), one FC head. ``norm: batch`` puts a
    BatchNorm after each convolution (``bn1``, ``bn2``: what FedBN keeps local; the published CNNs have none)."""

    def __init__(self, input_shape, num_classes, channels, kernel, padding, hidden, norm="none"):
        super().__init__()
        if norm not in ("none", "batch"):
            raise ValueError(f"norm: 'none' or 'batch' (got {norm!r})")
        c_in, h, w = input_shape
        c1, c2 = channels
        self.conv1 = nn.Conv2d(c_in, c1, kernel, padding=padding)
        self.conv2 = nn.Conv2d(c1, c2, kernel, padding=padding)
        self.bn1, self.bn2 = (nn.BatchNorm2d(c1), nn.BatchNorm2d(c2)) if norm == "batch" else (nn.Identity(),) * 2
        for _ in range(2):
            h, w = (h + 2 * padding - kernel + 1) // 2, (w + 2 * padding - kernel + 1) // 2
        if h < 1 or w < 1:
            raise ValueError(f"input {tuple(input_shape)} is too small for this CNN")
        self.fc1 = nn.Linear(c2 * h * w, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)
        self.feature_dim = hidden
        self.num_classes = num_classes

    def features(self, x):
        x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = torch.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        return torch.relu(self.fc1(x.flatten(1)))

    def head(self, z):
        return self.fc2(z)


def fedavg_cnn(input_shape, num_classes, norm="none"):
    """FedNTD/McMahan CNN: 5x5 convs with padding 2 (32, 64 channels), FC 512 (4096 for 3x32x32, 3136 for 1x28x28).
    norm: none (as published) or batch (a BatchNorm after each convolution)."""
    return _ConvNet(input_shape, num_classes, (32, 64), 5, 2, 512, norm)


def apfl_cnn(input_shape, num_classes, norm="none"):
    """APFL CNN: 5x5 convs (20, 50 channels) without padding, FC 800 (for 28x28: 50*4*4=800 inputs → 800 hidden).
    norm: none (as published) or batch (a BatchNorm after each convolution)."""
    return _ConvNet(input_shape, num_classes, (20, 50), 5, 0, 800, norm)


def cnn4(input_shape, num_classes, norm="none"):
    """4-layer CNN (pFedSRB; PFLlib's FedAvgCNN): 5x5 convs without padding (32, 64), FC 512, FC C.
    norm: none (as published) or batch (a BatchNorm after each convolution)."""
    return _ConvNet(input_shape, num_classes, (32, 64), 5, 0, 512, norm)
