"""IID: a random permutation cut into nearly equal parts."""

from __future__ import annotations

from typing import Literal

import numpy as np

from .base import PartitionScheme, Parts, require_samples_per_client


class IID(PartitionScheme):
    """Shuffle and cut into parts whose sizes differ by at most one (the first ``N mod K`` are larger)."""

    scheme: Literal["iid"] = "iid"

    def _split(self, labels: np.ndarray, n_clients: int, rng: np.random.Generator, groups) -> Parts:
        require_samples_per_client(len(labels), n_clients)
        return [np.sort(p).astype(np.int64) for p in np.array_split(rng.permutation(len(labels)), n_clients)]
