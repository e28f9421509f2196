"""A per-user cache of decoded arrays, so slow sources (60k JPEGs, LZMA npz) are decoded once."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ...paths import default_cache_dir
from ..base import ArrayDataset

log = logging.getLogger(__name__)

# Part of every key: bump it when a decoder's output changes, so caches written by older code are not reused.
CACHE_VERSION = 1
_KEY_CHARS = 16


def _key(sources: Sequence[Path]) -> str:
    """Identifies the sources by path, size and mtime: cheap, and any replacement of a file changes it."""
    h = hashlib.sha256(f"v{CACHE_VERSION}".encode())
    for p in sources:
        st = os.stat(p)
        h.update(f"\n{os.path.abspath(p)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:_KEY_CHARS]


def cached(
    tag: str, sources: Sequence[Path], build: Callable[[], dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """``build()``'s arrays, from ``<cache>/decoded/<tag>-<key>.npz`` when the sources are unchanged."""
    folder = default_cache_dir() / "decoded"
    path = folder / f"{tag}-{_key(sources)}.npz"
    if path.exists():
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # damaged: rebuild, don't fail
            log.warning("ignoring unreadable cache %s: %s", path, exc)
    arrays = build()
    _store(path, tag, arrays)
    return arrays


def _store(path: Path, tag: str, arrays: dict[str, np.ndarray]) -> None:
    """Write atomically (temp file + rename) so no reader sees half a file; drop older versions of it."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)  # uncompressed: loads in well under a second, zlib saved only ~10% here
        os.replace(tmp, path)
        tmp = None
        for old in path.parent.glob(f"{tag}-{'?' * _KEY_CHARS}.npz"):
            if old != path:
                old.unlink(missing_ok=True)
    except OSError as exc:  # a read-only or full cache disk costs speed, never the load itself
        log.warning("could not write cache %s: %s", path, exc)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def from_arrays(name: str, arrays: dict[str, np.ndarray], sources: list[str], meta: dict) -> ArrayDataset:
    """An ArrayDataset from a ``build()``/cache dict with x_/y_train, x_/y_test and classes."""
    return ArrayDataset(
        name=name,
        x_train=arrays["x_train"],
        y_train=arrays["y_train"].astype(np.int64),
        x_test=arrays["x_test"],
        y_test=arrays["y_test"].astype(np.int64),
        classes=[str(c) for c in arrays["classes"]],
        source_files=sources,
        meta=meta,
    )
