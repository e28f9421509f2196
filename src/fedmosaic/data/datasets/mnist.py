"""MNIST (Keras npz or official IDX files) and Fashion-MNIST (IDX files), as uint8 (N, 1, 28, 28)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np

from ..base import ArrayDataset
from ..registry import DatasetSpec, Layout, Source, register
from ._io import abs_paths, load_npz, read_idx, reading

_SPLITS = ("x_train", "y_train", "x_test", "y_test")
_IDX_STEMS = dict(zip(_SPLITS, (
    "train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte",
)))


def _dataset(
    name: str, arrays: dict[str, np.ndarray], classes: list[str], sources: list[Path], where: Path
) -> ArrayDataset:
    with reading(where):
        for split in ("train", "test"):
            x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
            if x.dtype != np.uint8 or x.ndim != 3 or y.shape != (len(x),):
                raise ValueError(f"x_{split} is {x.dtype}{list(x.shape)} with labels {y.shape}, "
                                 "not uint8[N,H,W] with N labels")
    return ArrayDataset(
        name=name,
        x_train=arrays["x_train"][:, None],
        y_train=arrays["y_train"].astype(np.int64),
        x_test=arrays["x_test"][:, None],
        y_test=arrays["y_test"].astype(np.int64),
        classes=classes,
        source_files=abs_paths(sources),
    )


def _read_npz(name: str, classes: list[str], folder: Path) -> ArrayDataset:
    path = folder / f"{name}.npz"
    return _dataset(name, load_npz(path, _SPLITS), classes, [path], path)


def _read_idx(name: str, classes: list[str], files: dict[str, str], folder: Path) -> ArrayDataset:
    paths = {k: folder / f for k, f in files.items()}
    return _dataset(name, {k: read_idx(p) for k, p in paths.items()}, classes, list(paths.values()), folder)


def idx_layouts(name: str, classes: list[str]) -> tuple[Layout, Layout]:
    """The official IDX file set, gzipped (as distributed) or already gunzipped."""
    def layout(suffix: str) -> Layout:
        files = {k: stem + suffix for k, stem in _IDX_STEMS.items()}
        return Layout(f"idx{suffix}", tuple(files.values()), partial(_read_idx, name, classes, files))

    return layout(".gz"), layout("")


DIGITS = [str(d) for d in range(10)]

MNIST = register(DatasetSpec(
    name="mnist",
    folder="mnist",
    layouts=(
        Layout("keras-npz", ("mnist.npz",), partial(_read_npz, "mnist", DIGITS)),
        *idx_layouts("mnist", DIGITS),
    ),
    description="MNIST handwritten digits, 60k/10k 28x28 greyscale",
    downloads=(Source(
        "mnist.npz",
        "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz",
        "731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1",
    ),),
))

# SHA-256 of the files Zalando serves (the ones TensorFlow Datasets pins). Debian's package recompresses them:
# its .gz bytes differ, the IDX data inside does not.
_FASHION_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
_FASHION_SHA256 = {
    "train-images-idx3-ubyte.gz": "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
    "train-labels-idx1-ubyte.gz": "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
    "t10k-images-idx3-ubyte.gz": "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
    "t10k-labels-idx1-ubyte.gz": "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
}
FASHION_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]

FASHION_MNIST = register(DatasetSpec(
    name="fashion-mnist",
    folder="fashion-mnist",  # Debian's dataset-fashion-mnist installs /usr/share/datasets/fashion-mnist/
    layouts=idx_layouts("fashion-mnist", FASHION_CLASSES),
    description="Fashion-MNIST clothing images, 60k/10k 28x28 greyscale",
    downloads=tuple(Source(f, _FASHION_URL + f, sha) for f, sha in _FASHION_SHA256.items()),
    aliases=("fmnist",),
))
