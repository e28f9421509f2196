"""CIFAR-10 and CIFAR-100 as uint8 (N, 3, 32, 32).

Both are registered at the top of the data directory (folder ``.``) because their layouts live in
differently named folders: the official python tarballs extract to ``cifar-10-batches-py/`` and
``cifar-100-python/`` (where Keras and torchvision put them too), the offline copies are ``cifar-10-jpeg/``
and ``cifar-100/``, and image folders go in ``cifar10/`` or ``cifar100/`` (``train|test/<class>/*.png|jpg``;
classes sorted by folder name, files by name).

``cifar10-gray`` is CIFAR-10 read from the same files and converted to one greyscale channel (APFL's CIFAR-10).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np

from ..base import ArrayDataset
from ..registry import DatasetSpec, Layout, Source, register
from ._cache import cached, from_arrays
from ._images import hwc_to_chw, is_image, read_image_splits
from ._io import abs_paths, archive_members, folder_members, load_npz, load_pickle, reading
from ._variants import greyscale

SIZE = (32, 32)
CIFAR10_BATCHES = tuple(f"cifar-10-batches-py/{f}" for f in (
    *(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"
))
CIFAR10_TARBALL = "cifar-10-jpeg/cifar10_jpeg_q75.tar.gz"


def _pickled(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    batch = load_pickle(path)
    with reading(path):
        x = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        y = np.asarray(batch[label_key], dtype=np.int64)
        if len(x) != len(y):
            raise ValueError(f"{len(x)} images but {len(y)} labels")
    return x, y


def _label_names(path: Path, key: bytes) -> list[str]:
    meta = load_pickle(path)
    with reading(path):
        return [n.decode() for n in meta[key]]


def _from_pickles(
    name: str, train: list[Path], test: Path, meta: Path, label_key: bytes, names_key: bytes
) -> ArrayDataset:
    parts = [_pickled(p, label_key) for p in train]
    x_test, y_test = _pickled(test, label_key)
    return ArrayDataset(
        name=name,
        x_train=np.concatenate([x for x, _ in parts]),
        y_train=np.concatenate([y for _, y in parts]),
        x_test=x_test,
        y_test=y_test,
        classes=_label_names(meta, names_key),
        source_files=abs_paths([*train, test, meta]),
    )


def _read_python10(folder: Path) -> ArrayDataset:
    d = folder / "cifar-10-batches-py"
    train = [d / f"data_batch_{i}" for i in range(1, 6)]
    return _from_pickles("cifar10", train, d / "test_batch", d / "batches.meta", b"labels", b"label_names")


def _read_python100(folder: Path) -> ArrayDataset:
    d = folder / "cifar-100-python"
    return _from_pickles(
        "cifar100", [d / "train"], d / "test", d / "meta", b"fine_labels", b"fine_label_names"
    )


def _read_folders(name: str, folder: Path) -> ArrayDataset:
    root = folder / name  # cifar10/ or cifar100/
    members = folder_members(root, lambda n: n.split("/", 1)[0] in ("train", "test") and is_image(n))
    arrays = cached(f"{name}-folders", list(members.values()), lambda: read_image_splits(members, root, SIZE))
    meta = {"lossy": "jpeg"} if any(n.lower().endswith((".jpg", ".jpeg")) for n in members) else {}
    return from_arrays(name, arrays, abs_paths([root / "train", root / "test"]), meta)


def _read_jpeg_tarball(folder: Path) -> ArrayDataset:
    path = folder / CIFAR10_TARBALL
    arrays = cached(
        "cifar10-jpeg-q75", [path], lambda: read_image_splits(archive_members(path, is_image), path, SIZE)
    )
    meta = {"lossy": "jpeg q75: pixels are not bit-exact, accuracies may sit a little below published ones"}
    return from_arrays("cifar10", arrays, abs_paths([path]), meta)


def _read_npz100(folder: Path) -> ArrayDataset:
    paths = [folder / "cifar-100" / f"cifar100_{s}.npz" for s in ("train", "test")]

    def build() -> dict[str, np.ndarray]:
        arrays = {"classes": load_npz(paths[0], ("fine_label_names",))["fine_label_names"]}
        for split, path in zip(("train", "test"), paths):
            z = load_npz(path, (f"x_{split}", f"y_{split}"))
            with reading(path):  # a wrongly shaped array fails the transpose
                arrays[f"x_{split}"], arrays[f"y_{split}"] = hwc_to_chw(z[f"x_{split}"]), z[f"y_{split}"]
        return arrays

    # LZMA-compressed: ~10 s to read, so the decoded arrays are cached like the JPEG sources
    arrays = cached("cifar100-npz", paths, build)
    meta = {"test_order": "sorted by class (the official test order is not recoverable from this copy)"}
    return from_arrays("cifar100", arrays, abs_paths(paths), meta)


CIFAR10 = register(DatasetSpec(
    name="cifar10",
    folder=".",
    layouts=(
        Layout("python", CIFAR10_BATCHES, _read_python10),
        Layout("image-folders", ("cifar10/train/", "cifar10/test/"), partial(_read_folders, "cifar10")),
        Layout("jpeg-tarball", (CIFAR10_TARBALL,), _read_jpeg_tarball),
    ),
    description="CIFAR-10 natural images, 10 classes, 50k/10k 32x32 RGB",
    downloads=(Source(
        "cifar-10-python.tar.gz",
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        "6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",
    ),),
))

CIFAR100 = register(DatasetSpec(
    name="cifar100",
    folder=".",
    layouts=(
        Layout("python", tuple(f"cifar-100-python/{f}" for f in ("train", "test", "meta")), _read_python100),
        Layout("npz", ("cifar-100/cifar100_train.npz", "cifar-100/cifar100_test.npz"), _read_npz100),
        Layout("image-folders", ("cifar100/train/", "cifar100/test/"), partial(_read_folders, "cifar100")),
    ),
    description="CIFAR-100 natural images, 100 fine classes, 50k/10k 32x32 RGB",
    downloads=(Source(
        "cifar-100-python.tar.gz",
        "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        "85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7",
    ),),
))

CINIC10 = register(DatasetSpec(
    name="cinic10",
    folder=".",
    layouts=(Layout("image-folders", ("cinic10/train/", "cinic10/test/"), partial(_read_folders, "cinic10")),),
    description="CINIC-10 (CIFAR-10 classes, CIFAR + downsampled ImageNet), 32x32 RGB; the official "
                "train/ and test/ folders (valid/ is not used). Not available offline.",
))

CIFAR10_GRAY = register(DatasetSpec(
    name="cifar10-gray",
    folder=".",
    layouts=tuple(Layout(lo.name, lo.files, greyscale(lo.read, "cifar10-gray")) for lo in CIFAR10.layouts),
    description="CIFAR-10 as 1-channel greyscale 32x32 (ITU-R 601-2 luma, as PIL's convert('L')); APFL's CIFAR-10",
    downloads=CIFAR10.downloads,
    aliases=("cifar10-grey",),
    variant_of="cifar10",
))
