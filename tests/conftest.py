"""Shared fixtures. Tests read real data from ../shared/data beside the repository (as CI has it)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()
DATA_PATH = os.pathsep.join([str(SHARED_DATA), "/usr/share/datasets"])


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path_factory):
    """Every test sees the shared data and a private cache, never the user's."""
    monkeypatch.setenv("FEDMOSAIC_DATA", os.environ.get("FEDMOSAIC_TEST_DATA", DATA_PATH))
    monkeypatch.setenv("FEDMOSAIC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def blobs(n_train=600, n_test=200, classes=5, shape=(1, 6, 6), seed=0):
    """A small learnable image dataset: class-dependent means plus noise, as uint8."""
    from fedmosaic.data.base import ArrayDataset

    rng = np.random.default_rng(seed)
    centers = rng.uniform(40, 215, size=(classes, *shape))

    def draw(n):
        y = rng.integers(0, classes, n)
        x = np.clip(centers[y] + rng.normal(0, 30, size=(n, *shape)), 0, 255).astype(np.uint8)
        return x, y.astype(np.int64)

    xtr, ytr = draw(n_train)
    xte, yte = draw(n_test)
    return ArrayDataset("blobs", xtr, ytr, xte, yte, [f"c{i}" for i in range(classes)])


def _register_blobs():
    """Users plug in their own data the same way: a DatasetSpec whose reader returns an ArrayDataset."""
    from fedmosaic.data.registry import REGISTRY, DatasetSpec, Layout, register

    if "blobs" not in REGISTRY:
        register(DatasetSpec("blobs", ".", (Layout("generated", (), lambda folder: blobs()),), builtin=True))


_register_blobs()


@pytest.fixture(scope="session")
def blob_data():
    return blobs()
