"""USPS handwritten digits in the *Elements of Statistical Learning* text format, as uint8 (N, 1, 16, 16)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..base import ArrayDataset
from ..registry import DatasetSpec, Layout, Source, register
from ._io import digit_splits, reading

_URL = "https://hastie.su.domains/ElemStatLearn/datasets/"


def _read_split(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One row per image: the label, then 256 grey values in [-1, 1] (row-major 16x16)."""
    with reading(path):
        rows = np.loadtxt(path, dtype=np.float64, ndmin=2)  # numpy gunzips *.gz itself
        if rows.shape[1] != 257:
            raise ValueError(f"rows have {rows.shape[1]} values, expected 257 (label + 16x16 pixels)")
    pixels = np.rint((rows[:, 1:] + 1.0) * 127.5).clip(0, 255).astype(np.uint8)
    return pixels.reshape(-1, 1, 16, 16), rows[:, 0].astype(np.int64)


def _read(folder: Path) -> ArrayDataset:
    return digit_splits("usps", [folder / f for f in ("zip.train.gz", "zip.test.gz")], _read_split)


USPS = register(DatasetSpec(
    name="usps",
    folder="usps",
    layouts=(Layout("esl-text", ("zip.train.gz", "zip.test.gz"), _read),),
    description="USPS handwritten digits, 7291/2007 16x16 greyscale",
    # no SHA-256 pinned: no published checksum for these files could be confirmed
    downloads=(Source("zip.train.gz", _URL + "zip.train.gz"), Source("zip.test.gz", _URL + "zip.test.gz")),
))
