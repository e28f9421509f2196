"""Vehicle sensor network (MOCHA, LEAF-style JSON): 100 features, one client per sensor, binary labels."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..base import ArrayDataset
from ..registry import DatasetSpec, Layout, register
from ._io import abs_paths, read_leaf_json, reading, stack_users

NO_TEST = (
    "mytest.json not found (the official test split is not available offline): x_test is None; "
    "derive a per-sensor split and report it as derived"
)


def _binary(y: np.ndarray, path: Path) -> np.ndarray:
    with reading(path):
        if not np.isin(y, (-1, 1)).all():
            raise ValueError(f"labels must be -1 or +1, found {sorted(set(np.unique(y)) - {-1.0, 1.0})[:5]}")
    return (y > 0).astype(np.int64)


def _read(folder: Path) -> ArrayDataset:
    train_path, test_path = folder / "mytrain.json", folder / "mytest.json"
    train = read_leaf_json([train_path])
    test = read_leaf_json([test_path]) if test_path.exists() else None
    sensors = list(train) + [u for u in (test or {}) if u not in train]  # the files' own (sensor) order
    x_train, y_train, g_train = stack_users(train, sensors)
    x_test = y_test = g_test = None
    if test is not None:
        x_test, y_test, g_test = stack_users(test, sensors)
        y_test = _binary(y_test, test_path)
    return ArrayDataset(
        name="vehicle",
        x_train=x_train,
        y_train=_binary(y_train, train_path),
        x_test=x_test,
        y_test=y_test,
        classes=["-1", "+1"],
        source_files=abs_paths([train_path] + ([test_path] if test is not None else [])),
        groups_train=g_train,
        groups_test=g_test,
        group_names=sensors,
        meta={} if test is not None else {"test_split": NO_TEST},
    )


VEHICLE = register(DatasetSpec(
    name="vehicle",
    folder="vehicle",
    layouts=(Layout("leaf-json", ("mytrain.json",), _read),),
    description="Vehicle sensor network (MOCHA): 23 sensors, 100 features, binary vehicle type",
))
