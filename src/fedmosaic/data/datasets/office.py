"""Office-Caltech-10: four domains (amazon, caltech, dslr, webcam), one client group per domain, 10 classes.

Two layouts, in differently named folders (so the spec sits at the top of the data directory): the 800-d
SURF bag-of-words features ``office-caltech10-surf/<domain>.mat`` (what is available offline), read as float32
(N, 800); or images ``office-caltech10/<domain>/<class>/*.jpg``, resized to uint8 (N, 3, 32, 32). Neither has
an official test split, so ``x_test`` is None: split per domain (client) downstream.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..base import ArrayDataset
from ..registry import DatasetSpec, Layout, register
from ._cache import cached
from ._images import class_tree, decode_images, flatten_classes, is_image
from ._io import abs_paths, folder_members, reading

DOMAINS = ["amazon", "caltech", "dslr", "webcam"]
# The SURF files' labels 1..10 follow the alphabetical class order (also the sorted image-folder order)
CLASSES = [
    "back_pack", "bike", "calculator", "headphones", "keyboard",
    "laptop_computer", "monitor", "mouse", "mug", "projector",
]
IMAGE_SIZE = (32, 32)
SURF_DIR, IMAGE_DIR = "office-caltech10-surf", "office-caltech10"
NO_TEST = "no official test split: x_test is None, split each domain downstream"


def _dataset(x, y, groups, classes: list[str], sources, meta) -> ArrayDataset:
    return ArrayDataset(
        name="office-caltech10",
        x_train=x,
        y_train=y.astype(np.int64),
        x_test=None,
        y_test=None,
        classes=classes,
        source_files=abs_paths(sources),
        groups_train=groups.astype(np.int64),
        group_names=list(DOMAINS),
        meta={"test_split": NO_TEST, **meta},
    )


def _read_surf_domain(path: Path) -> tuple[np.ndarray, np.ndarray]:
    import scipy.io  # here, not at start-up: most runs read no .mat file

    with reading(path):
        mat = scipy.io.loadmat(path)
        x, y = mat["feas"].astype(np.float32), mat["label"].reshape(-1).astype(np.int64) - 1
        if x.ndim != 2 or len(x) != len(y) or not np.isin(y, np.arange(len(CLASSES))).all():
            raise ValueError(f"feas is {list(x.shape)} with {len(y)} labels in 1..{len(CLASSES)} expected")
    return x, y


def _read_surf(folder: Path) -> ArrayDataset:
    paths = [folder / SURF_DIR / f"{d}.mat" for d in DOMAINS]
    parts = [_read_surf_domain(p) for p in paths]
    groups = np.repeat(np.arange(len(DOMAINS)), [len(y) for _, y in parts])
    x, y = np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])
    return _dataset(x, y, groups, CLASSES, paths, {"features": "800-d SURF bag-of-words, not images"})


def _read_images(folder: Path) -> ArrayDataset:
    root = folder / IMAGE_DIR
    members = folder_members(root, lambda n: n.split("/", 1)[0] in DOMAINS and is_image(n))

    def build() -> dict[str, np.ndarray]:
        tree = class_tree(members)
        classes = sorted({c for d in DOMAINS for c in tree.get(d, {})})
        names, labels = zip(*(flatten_classes(tree.get(d, {}), classes, root / d) for d in DOMAINS))
        flat = [n for part in names for n in part]
        return {
            "x": decode_images([members[n] for n in flat], flat, IMAGE_SIZE, root),
            "y": np.concatenate(labels),
            "groups": np.repeat(np.arange(len(DOMAINS)), [len(part) for part in names]),
            "classes": np.array(classes),
        }

    a = cached("office-caltech10-images", list(members.values()), build)
    meta = {"images": f"resized to {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} RGB"}
    classes = [str(c) for c in a["classes"]]
    return _dataset(a["x"], a["y"], a["groups"], classes, [root / d for d in DOMAINS], meta)


OFFICE = register(DatasetSpec(
    name="office-caltech10",
    folder=".",
    layouts=(
        Layout("surf", tuple(f"{SURF_DIR}/{d}.mat" for d in DOMAINS), _read_surf),
        Layout("image-folders", tuple(f"{IMAGE_DIR}/{d}/" for d in DOMAINS), _read_images),
    ),
    description="Office-Caltech-10 object recognition, 4 domains x 10 classes (SURF features or images)",
))


OFFICE_IMAGES = register(DatasetSpec(
    name="office-caltech10-images",
    folder=".",
    layouts=(OFFICE.layouts[1],),
    description="Office-Caltech-10 images only (AHF's image setting; the SURF files are not read): "
                "office-caltech10/<domain>/<class>/*.jpg, resized to 32x32 RGB",
    variant_of="office-caltech10",
))
