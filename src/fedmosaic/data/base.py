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
