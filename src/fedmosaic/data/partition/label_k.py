"""k classes per client (NIID-Bench "#label k"; pFedSRB's pathological split)."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from ...errors import ConfigError
from .base import (
    MAX_COUNT,
    PartitionScheme,
    Parts,
    class_members,
    class_ranks,
    even_sizes,
    parts_from_owner,
    require_samples_per_client,
)


class LabelK(PartitionScheme):
    """Each client holds exactly ``k`` distinct classes, each split evenly among the clients holding it.

    Client i's first class is ``i mod C`` (so every class is used when K >= C); its other k-1 classes are
    drawn uniformly without replacement from the rest. Classes are the distinct values in ``labels``.
    With fewer clients than classes some classes may be held by nobody: their samples are dropped (the only
    case in which this scheme drops samples).
    """

    scheme: Literal["label_k"] = "label_k"
    k: int = Field(2, ge=1, le=MAX_COUNT)

    def _split(self, labels: np.ndarray, n_clients: int, rng: np.random.Generator, groups) -> Parts:
        classes, ranks, _ = class_ranks(labels)
        n_classes = len(classes)
        if self.k > n_classes:
            raise ConfigError(f"partition.k: must be <= the number of classes {n_classes} (got {self.k})")
        # Each client gets >= 1 sample of each of its k classes, so N >= K * k; checking it before drawing
        # keeps a huge n_clients from allocating a huge key table (such a split fails below anyway).
        require_samples_per_client(len(labels), n_clients, self.k, "partition.k")
        # Ranking random keys, with the fixed first class forced to the front, draws the k-1 others
        # without replacement in one vectorised step.
        keys = rng.random((n_clients, n_classes))
        keys[np.arange(n_clients), np.arange(n_clients) % n_classes] = -1.0
        held = np.zeros((n_clients, n_classes), dtype=bool)
        np.put_along_axis(held, np.argsort(keys, axis=1)[:, : self.k], True, axis=1)

        owner = np.full(len(labels), -1, dtype=np.int64)
        members = class_members(ranks, n_classes)
        for j, c in enumerate(classes):
            holders = np.flatnonzero(held[:, j])
            if len(holders) == 0:
                continue
            idx = members[j]
            if len(idx) < len(holders):
                raise ConfigError(
                    f"partition.k: class {c} has {len(idx)} samples but {len(holders)} clients hold it; "
                    "lower k or n_clients"
                )
            owner[rng.permutation(idx)] = np.repeat(holders, even_sizes(len(idx), len(holders)))
        return parts_from_owner(owner, n_clients)
