"""scikit-learn's bundled 8x8 digits (1,797 images) as uint8 (N, 1, 8, 8), with a fixed stratified split."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..base import ArrayDataset
from ..registry import DatasetSpec, Layout, register

TEST_FRACTION = 0.2
SPLIT_SEED = 0


def _read(_folder: Path) -> ArrayDataset:
    # scikit-learn is imported here, not at start-up (a second of every run's start that reads no digits)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = np.rint(bunch.images * (255 / 16)).astype(np.uint8)[:, None]  # grey levels 0..16 -> 0..255
    y = bunch.target.astype(np.int64)
    # there is no official test set: a fixed, stratified split gives every run the same global one
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED
    )
    return ArrayDataset(
        name="digits",
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        classes=[str(d) for d in range(10)],
        meta={"derived_test": f"stratified {TEST_FRACTION:.0%} of the data, seed {SPLIT_SEED}"},
    )


DIGITS = register(DatasetSpec(
    name="digits",
    folder="digits",
    layouts=(Layout("scikit-learn", (), _read),),
    description="scikit-learn's 8x8 handwritten digits (bundled, no download)",
    builtin=True,
))
