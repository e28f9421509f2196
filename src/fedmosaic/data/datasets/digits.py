"""scikit-learn's bundled 8x8 digits (1,797 images) as uint8 (N, 1, 8, 8), with a fixed stratified split."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np

from ...errors import DataNotFoundError
from ..base import ArrayDataset
from ..registry import DatasetSpec, Layout, register

TEST_FRACTION = 0.2
SPLIT_SEED = 0
#: the split's sample order, train then test: scikit-learn's ``train_test_split(range(1797), test_size=0.2,
#: stratify=y, random_state=0)`` computed once and shipped (tests/data: it equals sklearn's), so that reading the
#: digits imports neither scikit-learn nor SciPy (1.4 s of every process that reads them: a deployed node's every
#: message, a Ray actor's start)
SPLIT = Path(__file__).with_name("digits_split.npy")


def _csv() -> Path:
    """scikit-learn's copy of the digits (its package's data file, found without importing the package)."""
    spec = importlib.util.find_spec("sklearn")
    path = None if spec is None else Path(list(spec.submodule_search_locations)[0]) / "datasets/data/digits.csv.gz"
    if path is None or not path.is_file():
        raise DataNotFoundError("dataset digits: it is scikit-learn's bundled copy: pip install scikit-learn")
    return path


def _read(_folder: Path) -> ArrayDataset:
    with gzip.open(_csv(), "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    images, target = data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    x = np.rint(images * (255 / 16)).astype(np.uint8)[:, None]  # grey levels 0..16 -> 0..255
    # there is no official test set: a fixed, stratified split gives every run the same global one
    order = np.load(SPLIT).astype(np.int64)
    cut = len(order) - int(np.ceil(TEST_FRACTION * len(order)))
    train, test = order[:cut], order[cut:]
    x_train, x_test, y_train, y_test = x[train], x[test], target[train], target[test]
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
