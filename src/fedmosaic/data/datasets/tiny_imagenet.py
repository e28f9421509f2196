"""Tiny-ImageNet-200 as uint8 (N, 3, 64, 64): the official train set, and the official val set as test set.

Read from the official zip directly or from its extracted folder. Classes are the WordNet ids of
``wnids.txt``, sorted; train files are sorted by name within a class; test follows
``val/val_annotations.txt``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..base import ArrayDataset
from ..registry import DatasetSpec, Layout, Source, register
from ._cache import cached, from_arrays
from ._images import decode_images, is_image
from ._io import abs_paths, archive_members, folder_members, reading
from ._variants import resized

SIZE = (64, 64)
ZIP, TOP = "tiny-imagenet-200.zip", "tiny-imagenet-200/"
WNIDS, VAL_ANNOTATIONS = "wnids.txt", "val/val_annotations.txt"
OFFICIAL_TRAIN_PER_CLASS = 500


def _wanted(name: str) -> bool:
    """wnids, val labels, and labelled images; the official test/ images have no labels and are skipped."""
    if name in (WNIDS, VAL_ANNOTATIONS):
        return True
    parts = name.split("/")
    train_image = len(parts) == 4 and parts[0] == "train" and parts[2] == "images"
    return is_image(name) and (train_image or parts[:2] == ["val", "images"])


def _text(item: bytes | Path) -> str:
    return (item if isinstance(item, bytes) else item.read_bytes()).decode()


def _build(members: Mapping[str, bytes | Path], where: Path) -> dict[str, np.ndarray]:
    with reading(where):
        wnids = sorted(_text(members[WNIDS]).split())
        index = {w: i for i, w in enumerate(wnids)}
        train = sorted(n for n in members if n.startswith("train/"))
        y_train = np.array([index[n.split("/")[1]] for n in train], dtype=np.int64)
        rows = [line.split("\t") for line in _text(members[VAL_ANNOTATIONS]).splitlines() if line.strip()]
        test = [f"val/images/{r[0]}" for r in rows]
        y_test = np.array([index[r[1]] for r in rows], dtype=np.int64)
        items = {s: [members[n] for n in names] for s, names in (("train", train), ("test", test))}
    return {
        "x_train": decode_images(items["train"], train, SIZE, where),
        "y_train": y_train,
        "x_test": decode_images(items["test"], test, SIZE, where),
        "y_test": y_test,
        "classes": np.array(wnids),
    }


def _dataset(arrays: dict[str, np.ndarray], sources: list[Path]) -> ArrayDataset:
    meta = {"test_split": "the official val set (the official test set has no labels)"}
    per_class = np.bincount(arrays["y_train"], minlength=len(arrays["classes"]))
    most = per_class.max(initial=0)
    if most < OFFICIAL_TRAIN_PER_CLASS:
        meta["subset"] = f"{most} train images per class at most (official: {OFFICIAL_TRAIN_PER_CLASS})"
    return from_arrays("tiny-imagenet", arrays, abs_paths(sources), meta)


def _read_zip(folder: Path) -> ArrayDataset:
    path = folder / ZIP

    def build() -> dict[str, np.ndarray]:
        raw = archive_members(path, lambda n: n.startswith(TOP) and _wanted(n.removeprefix(TOP)))
        return _build({n.removeprefix(TOP): b for n, b in raw.items()}, path)

    return _dataset(cached("tiny-imagenet-zip", [path], build), [path])


def _read_folder(folder: Path) -> ArrayDataset:
    members = folder_members(folder, _wanted)
    arrays = cached("tiny-imagenet-folder", list(members.values()), lambda: _build(members, folder))
    return _dataset(arrays, [folder / WNIDS, folder / "train", folder / "val"])


TINY_IMAGENET = register(DatasetSpec(
    name="tiny-imagenet",
    folder="tiny-imagenet-200",
    layouts=(
        Layout("zip", (ZIP,), _read_zip),
        Layout("extracted", (WNIDS, "train/", VAL_ANNOTATIONS), _read_folder),
    ),
    description="Tiny-ImageNet-200: 200 ImageNet classes, 100k train / 10k val 64x64 RGB",
    # no SHA-256 pinned: no published checksum for this zip could be confirmed
    downloads=(Source(ZIP, "http://cs231n.stanford.edu/tiny-imagenet-200.zip"),),
))


TINY_IMAGENET_32 = register(DatasetSpec(
    name="tiny-imagenet-32",
    folder=TINY_IMAGENET.folder,
    layouts=tuple(Layout(lo.name, lo.files, resized(lo.read, "tiny-imagenet-32", 32)) for lo in TINY_IMAGENET.layouts),
    description="Tiny-ImageNet-200 downsampled to 32x32 (bilinear, antialiased; as ImageNet32): CPU-sized runs",
    downloads=TINY_IMAGENET.downloads,
    variant_of="tiny-imagenet",
))
