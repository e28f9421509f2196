"""FEMNIST (LEAF): 62-class handwritten characters, one client per writer, as uint8 (N, 1, 28, 28).

Pixel convention: LEAF's, kept as is. LEAF stores 1.0 for the paper background and smaller values for ink,
so background is 255 and strokes are dark (the inverse of MNIST). Both layouts follow it: the JSON reader maps
x in [0, 1] to round(255 * x), and the npz copy is already stored that way.
"""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np

from ...errors import CorruptDataError
from ..base import ArrayDataset
from ..registry import DatasetSpec, Layout, register
from ._io import abs_paths, load_npz, read_leaf_json, reading, stack_users

CLASSES = list(string.digits + string.ascii_uppercase + string.ascii_lowercase)  # LEAF's label order
PIXELS = "LEAF convention: background 255, ink dark"
NPZ = "femnist_leaf_niid05_105writers.npz"


Split = tuple[np.ndarray, np.ndarray, np.ndarray]  # pixels uint8 (N, 784 or 28x28), labels, writer index


def _dataset(train: Split, test: Split, writers, sources: list[Path], meta: dict) -> ArrayDataset:
    return ArrayDataset(
        name="femnist",
        x_train=train[0].reshape(-1, 1, 28, 28),
        y_train=train[1].astype(np.int64),
        x_test=test[0].reshape(-1, 1, 28, 28),
        y_test=test[1].astype(np.int64),
        classes=CLASSES,
        source_files=abs_paths(sources),
        groups_train=train[2].astype(np.int64),
        groups_test=test[2].astype(np.int64),
        group_names=[str(w) for w in writers],
        meta={"pixels": PIXELS, **meta},
    )


def _read_json(folder: Path) -> ArrayDataset:
    """LEAF's own output: ``train/*.json`` and ``test/*.json``; a writer keeps one id across both splits."""
    files = {s: sorted((folder / s).glob("*.json")) for s in ("train", "test")}
    for split, paths in files.items():
        if not paths:
            raise CorruptDataError(f"{folder / split}: no LEAF .json files in it")
    users = {s: read_leaf_json(paths) for s, paths in files.items()}
    writers = sorted(users["train"].keys() | users["test"].keys())
    splits = {}
    for split, paths in files.items():
        x, y, groups = stack_users(users[split], writers)
        with reading(paths[0].parent):
            if x.shape[1] != 28 * 28:
                raise ValueError(f"samples have {x.shape[1]} values, expected 784 (28x28)")
        splits[split] = (np.rint(x * 255).clip(0, 255).astype(np.uint8), y, groups)
    return _dataset(splits["train"], splits["test"], writers, [*files["train"], *files["test"]], {})


def _read_npz(folder: Path) -> ArrayDataset:
    path = folder / NPZ
    keys = [f"{k}_{s}" for s in ("train", "test") for k in ("x", "y", "writer")]
    z = load_npz(path, [*keys, "writers"])
    splits = {s: (z[f"x_{s}"], z[f"y_{s}"], z[f"writer_{s}"]) for s in ("train", "test")}
    with reading(path):
        for split, (x, y, w) in splits.items():
            if x.dtype != np.uint8 or x.shape[1:] != (28, 28) or not len(x) == len(y) == len(w):
                raise ValueError(f"x_{split} is not uint8[N,28,28] with one y_{split} and writer_{split} each")
    meta = {"subset": "LEAF's 5% non-IID sample, only the writers that have both a train and a test split"}
    return _dataset(splits["train"], splits["test"], z["writers"], [path], meta)


FEMNIST = register(DatasetSpec(
    name="femnist",
    folder="femnist",
    layouts=(Layout("leaf-json", ("train/", "test/"), _read_json), Layout("npz", (NPZ,), _read_npz)),
    description="FEMNIST (LEAF) handwritten digits and letters, 62 classes, one client per writer",
))
