"""Decoding image files into (N, 3, H, W) arrays, and the ``<split>/<class>/<file>`` folder convention."""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from ...errors import CorruptDataError
from ._io import reading

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")


def is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_SUFFIXES)


def hwc_to_chw(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def _decode(item: bytes | Path, size: tuple[int, int]) -> np.ndarray:
    with Image.open(io.BytesIO(item) if isinstance(item, bytes) else item) as im:
        if im.size != size:
            im.draft("RGB", size)  # JPEG only: let libjpeg shrink big photos while decoding (much faster)
        rgb = im.convert("RGB")  # greyscale and palette images become 3-channel
    if rgb.size != size:
        rgb = rgb.resize(size, Image.Resampling.BILINEAR)
    return np.asarray(rgb)


def decode_images(
    items: Sequence[bytes | Path], names: Sequence[str], size: tuple[int, int], where: str | Path
) -> np.ndarray:
    """Decode encoded images (bytes, or paths) to uint8 RGB ``(N, 3, H, W)``, resizing to ``size`` = (W, H).

    Serial on purpose: for small images PIL's per-image Python overhead holds the GIL, and a thread pool was
    measured ~3x slower than this loop on CIFAR-10's 60k JPEGs.
    """
    out = np.empty((len(items), size[1], size[0], 3), np.uint8)
    for i, (item, name) in enumerate(zip(items, names)):
        with reading(f"{where}/{name}"):
            out[i] = _decode(item, size)
    return hwc_to_chw(out)


def class_tree(names: Iterable[str]) -> dict[str, dict[str, list[str]]]:
    """Group ``top/class/file`` names as ``{top: {class: [names, sorted]}}``; other depths are ignored."""
    tree: dict[str, dict[str, list[str]]] = {}
    for name in sorted(names):
        parts = name.split("/")
        if len(parts) == 3:
            tree.setdefault(parts[0], {}).setdefault(parts[1], []).append(name)
    return tree


def flatten_classes(
    by_class: Mapping[str, list[str]], classes: list[str], where: str | Path
) -> tuple[list[str], np.ndarray]:
    """Names in class order and their labels (index into ``classes``)."""
    unknown = sorted(set(by_class) - set(classes))
    if unknown:
        raise CorruptDataError(f"{where}: class folder(s) {', '.join(unknown)} do not exist in train/")
    names = [n for c in classes for n in by_class.get(c, [])]
    labels = np.repeat(np.arange(len(classes), dtype=np.int64), [len(by_class.get(c, [])) for c in classes])
    return names, labels


def read_image_splits(
    members: Mapping[str, bytes | Path], where: str | Path, size: tuple[int, int]
) -> dict[str, np.ndarray]:
    """Arrays for ``train/<class>/*`` and ``test/<class>/*``; classes are train's folder names, sorted."""
    tree = class_tree(n for n in members if is_image(n))
    missing = [s for s in ("train", "test") if s not in tree]
    if missing:
        raise CorruptDataError(f"{where}: no images in {' or '.join(s + '/<class>/' for s in missing)}")
    classes = sorted(tree["train"])
    arrays = {"classes": np.array(classes)}
    for split in ("train", "test"):
        names, arrays[f"y_{split}"] = flatten_classes(tree[split], classes, f"{where}/{split}")
        arrays[f"x_{split}"] = decode_images([members[n] for n in names], names, size, where)
    return arrays
