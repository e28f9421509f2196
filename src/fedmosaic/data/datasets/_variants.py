"""Datasets derived from another registered dataset's files (same samples, transformed pixels)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..base import ArrayDataset

# ITU-R 601-2 luma in PIL's fixed point: L = (19595 R + 38470 G + 7471 B + 2**15) >> 16, i.e.
# 0.299 R + 0.587 G + 0.114 B rounded to the nearest integer; bit-identical to ``Image.convert("L")``.
_LUMA = (19595, 38470, 7471)
_CHUNK = 8192


def luma(x: np.ndarray) -> np.ndarray:
    """uint8 RGB images (N, 3, H, W) to uint8 greyscale (N, 1, H, W)."""
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"expected uint8 RGB images (N, 3, H, W), got {x.dtype}{list(x.shape)}")
    out = np.empty((len(x), 1, *x.shape[2:]), np.uint8)
    for lo in range(0, len(x), _CHUNK):  # uint32 intermediates, one chunk at a time
        c = x[lo : lo + _CHUNK].astype(np.uint32)
        y = c[:, 0] * _LUMA[0] + c[:, 1] * _LUMA[1] + c[:, 2] * _LUMA[2] + (1 << 15)
        out[lo : lo + _CHUNK, 0] = (y >> 16).astype(np.uint8)
    return out


def to_greyscale(ds: ArrayDataset, name: str) -> ArrayDataset:
    return replace(
        ds,
        name=name,
        x_train=luma(ds.x_train),
        x_test=None if ds.x_test is None else luma(ds.x_test),
        meta={**ds.meta, "greyscale": f"{ds.name} converted with ITU-R 601-2 luma (PIL convert('L'))"},
        derived={},
    )


def greyscale(read: Callable[[Path], ArrayDataset], name: str) -> Callable[[Path], ArrayDataset]:
    """A layout reader that reads with ``read`` and converts the result to greyscale."""

    def read_grey(folder: Path) -> ArrayDataset:
        return to_greyscale(read(folder), name)

    return read_grey


def resized(read: Callable[[Path], ArrayDataset], name: str, size: int) -> Callable[[Path], ArrayDataset]:
    """A layout reader that reads with ``read`` and resizes every image to ``size`` x ``size`` (:func:`conform`)."""

    def read_resized(folder: Path) -> ArrayDataset:
        ds = read(folder)
        c = ds.x_train.shape[1]
        return replace(ds, name=name, x_train=conform(ds.x_train, c, (size, size)),
                       x_test=None if ds.x_test is None else conform(ds.x_test, c, (size, size)),
                       meta={**ds.meta, "resized": f"{ds.name} resized to {size}x{size} (bilinear, antialiased)"},
                       derived={})

    return read_resized


def conform(x: np.ndarray, channels: int, size: tuple[int, int]) -> np.ndarray:
    """uint8 images (N, C, H, W) as (N, ``channels``, *``size``): RGB to greyscale by :func:`luma`, a bilinear
    (antialiased) resize, greyscale repeated to 3 channels. Other channel counts are returned as they are."""
    if x.shape[1] == 3 and channels == 1:
        x = luma(x)
    if x.shape[2:] != tuple(size):
        import torch
        import torch.nn.functional as F

        out = np.empty((len(x), x.shape[1], *size), np.uint8)
        for lo in range(0, len(x), _CHUNK):
            t = F.interpolate(torch.as_tensor(x[lo : lo + _CHUNK]).float(), size=tuple(size), mode="bilinear",
                              align_corners=False, antialias=True)
            out[lo : lo + _CHUNK] = t.round().clamp(0, 255).to(torch.uint8).numpy()
        x = out
    return np.repeat(x, 3, axis=1) if x.shape[1] == 1 and channels == 3 else x
