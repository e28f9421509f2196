"""Label-distribution skew by Dirichlet allocation (LDA; NIID-Bench, FedNTD), guaranteed to terminate."""

from __future__ import annotations

import logging
from typing import Literal

import numpy as np
from pydantic import Field

from .base import PartitionScheme, Parts, owner_from_counts, parts_from_owner, require_samples_per_client

log = logging.getLogger(__name__)


class Dirichlet(PartitionScheme):
    """Per class, split over clients by q ~ Dir(alpha * 1_K); repeat until every client has ``min_size``.

    One pass visits the classes in order. Clients that already hold >= N/K samples take no more; the class is
    split by the cumulative sums of q restricted to the other clients and renormalised. Instead of drawing q
    over all K clients and zeroing the full ones, q is drawn directly over the open clients: by the Dirichlet
    aggregation property the renormalised restriction *is* Dir(alpha) over the open clients, and drawing it
    directly avoids a 0/0 when all the mass of a tiny-alpha draw sits on full clients.

    Up to ``max_retries`` passes are made. If none reaches ``min_size`` (small alpha with many clients), the
    pass with the largest minimum is repaired deterministically: each deficient client, smallest first, takes
    samples from the currently largest client, preferring a class it already holds (so its skew survives),
    otherwise the donor's most abundant class, never pushing the donor below ``min_size``. The repair succeeds
    whenever N >= K * min_size, which is checked up front; it is logged at INFO with the number of samples
    moved.
    """

    scheme: Literal["dirichlet"] = "dirichlet"
    alpha: float = Field(0.1, gt=0)
    min_size: int = Field(10, ge=0)
    max_retries: int = Field(100, ge=1)

    def _split(self, labels: np.ndarray, n_clients: int, rng: np.random.Generator, groups) -> Parts:
        require_samples_per_client(len(labels), n_clients, max(self.min_size, 1), "partition.min_size")
        class_sizes = np.bincount(labels)
        best = None
        for _ in range(self.max_retries):
            counts = self._one_pass(class_sizes, n_clients, rng)
            if best is None or counts.sum(1).min() > best.sum(1).min():
                best = counts
            if best.sum(1).min() >= self.min_size:
                break
        else:
            moved = _repair(best, self.min_size)
            log.info(
                "dirichlet(alpha=%g): no pass reached min_size=%d in %d tries; repaired by moving %d samples",
                self.alpha,
                self.min_size,
                self.max_retries,
                moved,
            )
        return parts_from_owner(owner_from_counts(labels, best, rng), n_clients)

    def _one_pass(self, class_sizes: np.ndarray, n_clients: int, rng: np.random.Generator) -> np.ndarray:
        """Client x class counts of one LDA pass."""
        counts = np.zeros((n_clients, len(class_sizes)), dtype=np.int64)
        held = np.zeros(n_clients, dtype=np.int64)
        cap = class_sizes.sum() / n_clients
        for c, n_c in enumerate(class_sizes):
            if n_c == 0:
                continue
            # Some client is always open: the classes before c sum to less than N, so not all can hold N/K.
            open_ = np.flatnonzero(held < cap)
            q = rng.dirichlet(np.full(len(open_), self.alpha))
            cuts = np.minimum((np.cumsum(q) * n_c).astype(np.int64), n_c)
            cuts[-1] = n_c
            counts[open_, c] = np.diff(cuts, prepend=0)
            held += counts[:, c]
        return counts


def _repair(counts: np.ndarray, min_size: int) -> int:
    """Move samples into clients below ``min_size`` in place; returns how many were moved."""
    sizes = counts.sum(1)
    moved = 0
    for r in np.lexsort((np.arange(len(sizes)), sizes)):
        while sizes[r] < min_size:
            donor = int(np.argmax(sizes))
            spare = counts[donor] * (counts[r] > 0)
            c = int(np.argmax(spare)) if spare.any() else int(np.argmax(counts[donor]))
            # t >= 1: while anyone is short the largest client is above min_size, because N >= K * min_size.
            t = int(min(min_size - sizes[r], counts[donor, c], sizes[donor] - min_size))
            counts[donor, c] -= t
            counts[r, c] += t
            sizes[donor] -= t
            sizes[r] += t
            moved += t
    return moved
