"""Domain-shift datasets (AHF, METHODS.md §1 "Domains"): MNIST-M, SynthDigits, and the Digits composites whose
clients are whole datasets.

``mnist-m``: MNIST digits blended over BSDS500 patches, 32x32 RGB, read from image folders
``train|test/<label>/<file>.png`` in ``mnist-m/`` or the zip that holds them (``mnist_m_subset.zip`` offline: the
first 5,000 train images and the full test set). ``syn``: SynthDigits (Ganin & Lempitsky), ``synth_train_32x32.mat``
and ``synth_test_32x32.mat`` in SVHN's MATLAB format.

``digits-domains``: MNIST, USPS, SVHN, SYN — AHF's Digits; ``digits-offline``: MNIST, USPS, MNIST-M — the domains
this machine has, a real domain shift (greyscale handwriting against colour-blended digits). Every domain is
resized to 32x32 (bilinear) with greyscale repeated to 3 channels; ``groups_train``/``groups_test`` give the
domain, so ``partition: {scheme: domains, sizes: [...]}`` makes one client per domain with its private size.
A missing domain is a one-line error naming it and how to get it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..base import ArrayDataset
from ..registry import DatasetSpec, Layout, load_dataset, register
from ._cache import cached, from_arrays
from ._images import is_image, read_image_splits
from ._io import abs_paths, archive_members, digit_splits, folder_members
from ._variants import conform
from .svhn import _read_split as _read_svhn_mat

SIZE = 32
MNISTM_ZIP = "mnist_m_subset.zip"


def _read_mnistm_zip(folder: Path) -> ArrayDataset:
    path = folder / MNISTM_ZIP
    arrays = cached("mnist-m-zip", [path],
                    lambda: read_image_splits(archive_members(path, is_image), path, (SIZE, SIZE)))
    return from_arrays("mnist-m", arrays, abs_paths([path]), {"subset": "as shipped in " + MNISTM_ZIP})


def _read_mnistm_folders(folder: Path) -> ArrayDataset:
    members = folder_members(folder, lambda n: n.split("/", 1)[0] in ("train", "test") and is_image(n))
    arrays = cached("mnist-m-folders", list(members.values()),
                    lambda: read_image_splits(members, folder, (SIZE, SIZE)))
    return from_arrays("mnist-m", arrays, abs_paths([folder / "train", folder / "test"]), {})


register(DatasetSpec(
    name="mnist-m",
    folder="mnist-m",
    layouts=(Layout("zip", (MNISTM_ZIP,), _read_mnistm_zip), Layout("image-folders", ("train/", "test/"),
                                                                     _read_mnistm_folders)),
    description="MNIST-M: MNIST digits blended over BSDS500 patches, 32x32 RGB",
    aliases=("mnistm",),
))


def _read_syn(folder: Path) -> ArrayDataset:
    return digit_splits("syn", [folder / f for f in ("synth_train_32x32.mat", "synth_test_32x32.mat")],
                        _read_svhn_mat)


register(DatasetSpec(
    name="syn",
    folder="syn",
    layouts=(Layout("mat", ("synth_train_32x32.mat", "synth_test_32x32.mat"), _read_syn),),
    description="SynthDigits (Ganin & Lempitsky): synthetic digits, 32x32 RGB, SVHN's .mat format "
                "(get it from the DANN project page or a FedBN/FCCL data bundle)",
    aliases=("synth-digits", "synthdigits"),
))


def composite(name: str, domains: list[str]) -> ArrayDataset:
    """The ``domains`` datasets as one, 32x32 RGB, each sample's domain in ``groups_train``/``groups_test``."""
    parts = [load_dataset(d) for d in domains]
    x_tr = [conform(p.x_train, 3, (SIZE, SIZE)) for p in parts]
    x_te = [conform(p.x_test, 3, (SIZE, SIZE)) for p in parts]
    return ArrayDataset(
        name=name,
        x_train=np.concatenate(x_tr),
        y_train=np.concatenate([p.y_train for p in parts]).astype(np.int64),
        x_test=np.concatenate(x_te),
        y_test=np.concatenate([p.y_test for p in parts]).astype(np.int64),
        classes=[str(d) for d in range(10)],
        source_files=[f for p in parts for f in p.source_files],
        groups_train=np.repeat(np.arange(len(parts)), [len(p.y_train) for p in parts]),
        groups_test=np.repeat(np.arange(len(parts)), [len(p.y_test) for p in parts]),
        group_names=list(domains),
        meta={"domains": domains, "images": "32x32 RGB (bilinear; greyscale repeated to 3 channels)"},
    )


DIGIT_DOMAINS = {"digits-domains": ["mnist", "usps", "svhn", "syn"], "digits-offline": ["mnist", "usps", "mnist-m"]}

for _name, _domains in DIGIT_DOMAINS.items():
    register(DatasetSpec(
        name=_name,
        folder=".",
        layouts=(Layout("composite", (), lambda _folder, n=_name, d=_domains: composite(n, d)),),
        description=f"Digits domains {', '.join(_domains)}: one client per domain, 32x32 RGB",
        parts=tuple(_domains),
    ))
