"""The in-memory form every dataset loader returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class ArrayDataset:
    """A whole dataset as contiguous numpy arrays.

    Images are ``uint8`` in ``(N, C, H, W)``; feature datasets are ``float32`` in ``(N, D)``. Labels are ``int64``
    in ``[0, num_classes)``. ``groups_*`` hold a natural client id per sample (FEMNIST writer, Vehicle sensor,
    Office-Caltech domain) where the dataset has one, indexing into ``group_names``.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray | None
    y_test: np.ndarray | None
    classes: list[str]
    source_files: list[str] = field(default_factory=list)
    groups_train: np.ndarray | None = None
    groups_test: np.ndarray | None = None
    group_names: list[str] | None = None
    meta: dict = field(default_factory=dict)
    #: memoised values derived from the arrays (pooled train+test, content fingerprint); not part of the data
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def is_image(self) -> bool:
        return self.x_train.ndim == 4

    def __post_init__(self) -> None:
        if len(self.x_train) != len(self.y_train):
            raise ValueError(f"{self.name}: {len(self.x_train)} train inputs but {len(self.y_train)} labels")
        if self.x_test is not None and len(self.x_test) != len(self.y_test):
            raise ValueError(f"{self.name}: {len(self.x_test)} test inputs but {len(self.y_test)} labels")


def select_classes(ds: ArrayDataset, classes: list[int]) -> ArrayDataset:
    """The samples of ``classes`` only, relabelled 0..len(classes)-1 in the given order (e.g. FEMNIST's a-j)."""
    from ..errors import ConfigError

    bad = [c for c in classes if not 0 <= c < ds.num_classes]
    if bad or len(set(classes)) != len(classes):
        raise ConfigError(f"data.classes: must be distinct class ids in [0, {ds.num_classes}) (got {classes})")
    lut = np.full(ds.num_classes, -1, dtype=np.int64)
    lut[classes] = np.arange(len(classes))

    def pick(x, y, g):
        if y is None:
            return x, y, g
        keep = lut[y] >= 0
        return x[keep], lut[y[keep]], None if g is None else g[keep]

    xtr, ytr, gtr = pick(ds.x_train, ds.y_train, ds.groups_train)
    xte, yte, gte = pick(ds.x_test, ds.y_test, ds.groups_test)
    return ArrayDataset(f"{ds.name}[{','.join(map(str, classes))}]", xtr, ytr, xte, yte,
                        [ds.classes[c] for c in classes], ds.source_files, gtr, gte, ds.group_names,
                        {**ds.meta, "classes_from": ds.name})
