"""k classes per client (NIID-Bench "#label k"; pFedSRB's pathological split)."""

from __future__ import annotations

import warnings
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
    case in which this scheme drops samples). That happens even when K * k >= C: 20 clients x 10 of
    CIFAR-100's 100 classes leave ~12 classes (~12% of the samples) unheld.

    ``balanced=True`` deals the classes instead, as PFLlib's pathological split does: the classes in a random
    order, client i taking the k consecutive ones from position i*k (cyclically). Every class then has
    floor or ceil(K*k/C) holders, so none is dropped when K*k >= C (clients i and i + C/k get the same
    classes when k divides C, as in PFLlib).
    """

    scheme: Literal["label_k"] = "label_k"
    k: int = Field(2, ge=1, le=MAX_COUNT)
    balanced: bool = False

    def _split(self, labels: np.ndarray, n_clients: int, rng: np.random.Generator, groups) -> Parts:
        classes, ranks, class_sizes = class_ranks(labels)
        n_classes = len(classes)
        if self.k > n_classes:
            raise ConfigError(f"partition.k: must be <= the number of classes {n_classes} (got {self.k})")
        # Each client gets >= 1 sample of each of its k classes, so N >= K * k; checking it before drawing
        # keeps a huge n_clients from allocating a huge key table (such a split fails below anyway).
        require_samples_per_client(len(labels), n_clients, self.k, "partition.k")
        held = np.zeros((n_clients, n_classes), dtype=bool)
        if self.balanced:
            order = rng.permutation(n_classes)
            slots = (np.arange(n_clients)[:, None] * self.k + np.arange(self.k)) % n_classes
            np.put_along_axis(held, order[slots], True, axis=1)
        else:
            # Ranking random keys, with the fixed first class forced to the front, draws the k-1 others
            # without replacement in one vectorised step.
            keys = rng.random((n_clients, n_classes))
            keys[np.arange(n_clients), np.arange(n_clients) % n_classes] = -1.0
            np.put_along_axis(held, np.argsort(keys, axis=1)[:, : self.k], True, axis=1)

        unheld = ~held.any(0)
        if unheld.any():  # (the one case in which this scheme drops samples: a user should know)
            dropped = int(class_sizes[unheld].sum())
            warnings.warn(f"partition label_k(k={self.k}): no client holds {int(unheld.sum())} of the {n_classes} "
                          f"classes; their {dropped:,} of {len(labels):,} samples are left out (balanced: true holds "
                          "every class when clients x k >= classes)", stacklevel=2)
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
