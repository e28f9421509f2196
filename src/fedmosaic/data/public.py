"""Unlabeled public data for model-heterogeneous FL: another dataset's train images in the private data's shape."""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .registry import load_dataset


def public_images(source: str, size: int, shape: tuple, gen: np.random.Generator) -> np.ndarray:
    """``size`` of dataset ``source``'s train images drawn with ``gen`` (without replacement), as uint8 of ``shape``
    (C, H, W): resized bilinearly, RGB to greyscale by ITU-R 601-2 luma or greyscale repeated to 3 channels."""
    ds = load_dataset(source)
    if len(shape) != 3 or not ds.is_image or ds.x_train.dtype != np.uint8:
        raise ConfigError(f"data.public.source: {source!r} is not an image dataset, or the private data "
                          f"(inputs of shape {tuple(shape)}) are not images; use 'noise'")
    if size > len(ds.x_train):
        raise ConfigError(f"data.public.size: {source!r} has {len(ds.x_train):,} train images (got {size:,})")
    x = ds.x_train[np.sort(gen.choice(len(ds.x_train), size=size, replace=False))]
    c, h, w = shape
    if x.shape[1] == 3 and c == 1:
        from .datasets._variants import luma

        x = luma(x)
    if x.shape[2:] != (h, w):
        import torch
        import torch.nn.functional as F

        t = F.interpolate(torch.as_tensor(x).float(), size=(h, w), mode="bilinear", align_corners=False,
                          antialias=True)
        x = t.round().clamp(0, 255).to(torch.uint8).numpy()
    if x.shape[1] == 1 and c == 3:
        x = np.repeat(x, 3, axis=1)
    if x.shape[1] != c:
        raise ConfigError(f"data.public.source: {source!r} has {x.shape[1]} channels, the private data {c}")
    return np.ascontiguousarray(x)
