"""Input transforms as batched tensor ops, applied on the fly to gathered batches (so they run inside the fast path).
"""

from __future__ import annotations

import numpy as np
import torch


class Normalize:
    """uint8 images → float in [0, 1] → z-scored with statistics of the federation's training samples."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, scale: float):
        self.mean, self.std, self.scale = mean, std, scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.float32) * self.scale - self.mean) / self.std


def make_normalizer(kind: str, x_train: np.ndarray, device) -> Normalize:
    scale = 1 / 255 if x_train.dtype == np.uint8 else 1.0
    shape = x_train.shape[1:]
    if kind == "none" or len(x_train) == 0:
        return Normalize(torch.zeros(()), torch.ones(()), scale)
    x = torch.as_tensor(x_train)
    # statistics in float64 over chunks: exact enough and no float32 copy of the whole split
    axes = (0,) if kind == "pixel" or len(shape) == 1 else (0, 2, 3)
    total = torch.zeros(shape if kind == "pixel" or len(shape) == 1 else (shape[0], 1, 1), dtype=torch.float64)
    sq = torch.zeros_like(total)
    for lo in range(0, len(x), 8192):
        xb = x[lo : lo + 8192].to(torch.float64) * scale
        total += xb.sum(axes, keepdim=len(axes) > 1).reshape(total.shape)
        sq += (xb * xb).sum(axes, keepdim=len(axes) > 1).reshape(total.shape)
    count = len(x) * (1 if len(axes) == 1 else shape[1] * shape[2])
    mean = total / count
    std = (sq / count - mean * mean).clamp(min=0).sqrt()
    std = torch.where(std < 1e-6, torch.ones_like(std), std)  # constant pixels (MNIST borders) stay at 0
    return Normalize(mean.float().to(device), std.float().to(device), scale)
