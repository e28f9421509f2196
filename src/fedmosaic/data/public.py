"""Unlabeled public data for model-heterogeneous FL: another dataset's train images in the private data's shape."""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .datasets._variants import conform
from .registry import load_dataset


def public_images(source: str, size: int, shape: tuple, gen: np.random.Generator) -> np.ndarray:
    """``size`` of dataset ``source``'s train images drawn with ``gen`` (without replacement), as uint8 of ``shape``
    (C, H, W) (``datasets._variants.conform``: resized, RGB to greyscale or greyscale to RGB)."""
    ds = load_dataset(source)
    if len(shape) != 3 or not ds.is_image or ds.x_train.dtype != np.uint8:
        raise ConfigError(f"data.public.source: {source!r} is not an image dataset, or the private data "
                          f"(inputs of shape {tuple(shape)}) are not images; use 'noise'")
    if size > len(ds.x_train):
        raise ConfigError(f"data.public.size: {source!r} has {len(ds.x_train):,} train images (got {size:,})")
    x = ds.x_train[np.sort(gen.choice(len(ds.x_train), size=size, replace=False))]
    c, h, w = shape
    x = conform(x, c, (h, w))
    if x.shape[1] != c:
        raise ConfigError(f"data.public.source: {source!r} has {x.shape[1]} channels, the private data {c}")
    return np.ascontiguousarray(x)
