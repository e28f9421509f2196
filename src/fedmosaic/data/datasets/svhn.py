"""SVHN cropped digits (``train_32x32.mat``, ``test_32x32.mat``) as uint8 (N, 3, 32, 32), labels 0..9."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..base import ArrayDataset
from ..registry import DatasetSpec, Layout, Source, register
from ._io import digit_splits, reading

_URL = "http://ufldl.stanford.edu/housenumbers/"


def _read_split(path: Path) -> tuple[np.ndarray, np.ndarray]:
    import scipy.io  # here, not at start-up: most runs read no .mat file

    with reading(path):
        mat = scipy.io.loadmat(path)
        x, y = mat["X"], mat["y"].reshape(-1)
        if x.shape[:3] != (32, 32, 3) or x.shape[3] != len(y):
            raise ValueError(f"X is {list(x.shape)} with {len(y)} labels, expected [32,32,3,N]")
    # X is MATLAB's (H, W, C, N); the label 10 stands for the digit 0
    return np.ascontiguousarray(x.transpose(3, 2, 0, 1), dtype=np.uint8), (y % 10).astype(np.int64)


def _read(folder: Path) -> ArrayDataset:
    return digit_splits("svhn", [folder / f for f in ("train_32x32.mat", "test_32x32.mat")], _read_split)


SVHN = register(DatasetSpec(
    name="svhn",
    folder="svhn",
    layouts=(Layout("mat", ("train_32x32.mat", "test_32x32.mat"), _read),),
    description="SVHN street-view house-number digits, 73257/26032 32x32 RGB",
    downloads=(
        Source("train_32x32.mat", _URL + "train_32x32.mat",
               "435e94d69a87fde4fd4d7f3dd208dfc32cb6ae8af2240d066de1df7508d083b8"),
        Source("test_32x32.mat", _URL + "test_32x32.mat",
               "cdce80dfb2a2c4c6160906d0bd7c68ec5a99d7ca4831afa54f09182025b6a75b"),
    ),
))
