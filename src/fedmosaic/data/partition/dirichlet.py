"""Label-distribution skew by Dirichlet allocation (LDA; NIID-Bench, FedNTD), guaranteed to terminate."""

from __future__ import annotations

import warnings
from typing import Literal

import numpy as np
from pydantic import Field

from ...errors import ConfigError
from .base import (
    MAX_RETRIES,
    MAX_SAMPLES,
    PartitionScheme,
    Parts,
    class_ranks,
    owner_from_counts,
    parts_from_owner,
    require_samples_per_client,
)


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

    ``alpha`` is at most 1e6 (beyond that Dir(alpha) is indistinguishable from an even split, and near 1e308
    numpy's draw overflows to all zeros or NaN). A draw that is nevertheless degenerate (NaN or all zeros)
    puts the whole class on one open client chosen by ``rng``.
    """

    scheme: Literal["dirichlet"] = "dirichlet"
    alpha: float = Field(0.1, gt=0, le=1e6)
    min_size: int = Field(10, ge=0, le=MAX_SAMPLES)
    max_retries: int = Field(100, ge=1, le=MAX_RETRIES)

    def _split(self, labels: np.ndarray, n_clients: int, rng: np.random.Generator, groups) -> Parts:
        require_samples_per_client(len(labels), n_clients, max(self.min_size, 1), "partition.min_size")
        # Classes as ranks: absent label values take no randomness, so this is the split of the raw labels.
        _, labels, class_sizes = class_ranks(labels)
        best = None
        for _ in range(self.max_retries):
            counts = self._one_pass(class_sizes, n_clients, rng)
            if best is None or counts.sum(1).min() > best.sum(1).min():
                best = counts
            if best.sum(1).min() >= self.min_size:
                break
        else:
            moved = _repair(best, self.min_size)
            # (a user should know the partition is not a plain LDA draw; the same for every run of this setting)
            warnings.warn(f"partition dirichlet(alpha={self.alpha:g}): no draw of {self.max_retries} gave every client "
                          f"min_size={self.min_size} samples; the best was repaired by moving {moved} of "
                          f"{len(labels):,} samples", stacklevel=2)
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
            if len(open_) == 0:  # unreachable (see above); a guard against rounding in cap
                open_ = np.arange(n_clients)
            q = rng.dirichlet(np.full(len(open_), self.alpha))
            if not (np.isfinite(q).all() and q.sum() > 0):
                # A degenerate draw (alpha out of range): the limit of a very peaked Dirichlet, one client.
                q = np.zeros(len(open_))
                q[rng.integers(len(open_))] = 1.0
            cuts = np.minimum((np.cumsum(q) * n_c).astype(np.int64), n_c)
            cuts[-1] = n_c
            counts[open_, c] = np.diff(cuts, prepend=0)
            held += counts[:, c]
        return counts


def _repair(counts: np.ndarray, min_size: int) -> int:
    """Move samples into clients below ``min_size`` in place; returns how many were moved.

    Every move gives the short client t >= 1 samples, so the loops end after at most K * min_size moves. If a
    move of t < 1 would happen (only possible when ``counts`` has negative entries or sums to less than
    K * min_size, which ``_split`` rules out) a ConfigError is raised instead of looping forever.
    """
    sizes = counts.sum(1)
    if (counts < 0).any() or sizes.sum() < len(sizes) * min_size:
        raise ConfigError(
            f"partition.min_size: cannot give each of {len(sizes)} clients {min_size} samples out of "
            f"{max(int(sizes.sum()), 0)}"
        )
    moved = 0
    for r in np.lexsort((np.arange(len(sizes)), sizes)):
        while sizes[r] < min_size:
            donor = int(np.argmax(sizes))
            spare = counts[donor] * (counts[r] > 0)
            c = int(np.argmax(spare)) if spare.any() else int(np.argmax(counts[donor]))
            # t >= 1: while anyone is short the largest client is above min_size, because N >= K * min_size.
            t = int(min(min_size - sizes[r], counts[donor, c], sizes[donor] - min_size))
            if t < 1 or donor == r:
                raise ConfigError(
                    f"partition.min_size: the Dirichlet repair stalled: client {r} holds {sizes[r]} < "
                    f"{min_size} samples and the largest client {donor} has none to spare"
                )
            counts[donor, c] -= t
            counts[r, c] += t
            sizes[donor] -= t
            sizes[r] += t
            moved += t
    return moved
