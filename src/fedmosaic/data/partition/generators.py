"""The FedProx data generators used by APFL: power-law MNIST and lognormal FEMNIST letters.

Both give user u the classes u, u+1, ... (mod C) and differ in how sizes are drawn. Classes are the distinct
values in ``labels`` in ascending order, so "class u mod C" is the (u mod C)-th of them.
"""

from __future__ import annotations

import logging
from typing import Literal

import numpy as np
from pydantic import Field

from ...errors import ConfigError
from .base import (
    MAX_COUNT,
    MAX_SAMPLES,
    MAX_SIGMA,
    PartitionScheme,
    Parts,
    class_members,
    fixed_clients,
    largest_remainder,
    parts_from_owner,
    usable_weights,
)

log = logging.getLogger(__name__)

# LEAF's FEMNIST label order is 0-9 digits, 10-35 upper case, 36-61 lower case.
_LOWER_A, _LOWER_J = 36, 45
# The largest float64 below 2**63: per-user requests are capped here so that an overflowed lognormal draw
# converts to int64 instead of wrapping around to a negative count. Smaller requests are unchanged.
_MAX_REQUEST = float(2**63 - 1024)
# At most this many (user, class) slots: several arrays of this length are built.
_MAX_SLOTS = 10**7


def femnist_letters_a_to_j(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FedProx's FEMNIST subset: a mask of the lower-case a-j samples, and their labels relabelled 0-9.

    Expects LEAF's 62-class labels; apply the mask to the inputs and pass the new labels to
    ``femnist_lognormal``.
    """
    labels = np.asarray(labels)
    mask = (labels >= _LOWER_A) & (labels <= _LOWER_J)
    return mask, (labels[mask] - _LOWER_A).astype(np.int64)


class _ClassCycleGenerator(PartitionScheme):
    users: int
    classes_per_user: int

    def num_clients(self, n_requested: int | None, groups: np.ndarray | None = None) -> int:
        return fixed_clients(n_requested, self.users, f"partition scheme '{self.scheme}' (partition.users)")

    def _slots(self, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Labels as class ranks 0..C-1, and the (users x classes_per_user) table of each user's classes."""
        classes, ranks = np.unique(labels, return_inverse=True)
        if self.classes_per_user > len(classes):
            raise ConfigError(
                f"partition.classes_per_user: must be <= the number of classes {len(classes)} "
                f"(got {self.classes_per_user})"
            )
        if self.users * self.classes_per_user > _MAX_SLOTS:
            raise ConfigError(
                f"partition.classes_per_user: users * classes_per_user = {self.users} * "
                f"{self.classes_per_user} (user, class) slots is more than {_MAX_SLOTS}"
            )
        slot_class = (np.arange(self.users)[:, None] + np.arange(self.classes_per_user)) % len(classes)
        return ranks.astype(np.int64), slot_class

    def _assign(self, ranks: np.ndarray, slot_class: np.ndarray, take: np.ndarray, rng) -> Parts:
        """Give each (user, class) slot ``take`` random samples of its class; the rest are dropped.

        Per class the users holding it are listed in ascending order, so this is ``owner_from_counts`` on the
        (users x classes) count matrix without building that matrix (users * classes can be large).
        """
        n_classes = int(ranks.max()) + 1
        user = np.repeat(np.arange(self.users), slot_class.shape[1])
        cls, t = slot_class.ravel(), take.ravel()
        order = np.lexsort((user, cls))
        user, cls, t = user[order], cls[order], t[order]
        bounds = np.searchsorted(cls, np.arange(n_classes + 1))
        owner = np.full(len(ranks), -1, dtype=np.int64)
        for c, members in enumerate(class_members(ranks, n_classes)):
            holders, col = user[bounds[c] : bounds[c + 1]], t[bounds[c] : bounds[c + 1]]
            if col.any():
                owner[rng.permutation(members)[: int(col.sum())]] = np.repeat(holders, col)
        return parts_from_owner(owner, self.users)


class APFLMnist(_ClassCycleGenerator):
    """FedProx's power-law MNIST (APFL's MNIST): 1000 users, two consecutive digits each.

    Expects pooled MNIST train+test labels (70,000). Every user first takes ``first`` samples of each of its
    classes; the rest of each class is shared among the (user, class) slots holding it in proportion to
    lognormal(0, sigma) draws. As in the original, shares are floored and the remainders dropped (about half
    a sample per slot: ~69,050 of 70,000 kept; APFL reports 69,035); with ``drop_remainder=False`` they are
    dealt by largest remainder and every sample of a held class is used (when users + classes_per_user - 1
    < C, the classes no user holds are dropped either way). Samples within a class are drawn at random.

    Decision (sigma): the default 2.0 is the published code's. It gives a per-user std of ~165 (120-250
    over seeds), not the 106 that FedProx and APFL report for their one draw; ``sigma=1.55`` gives 106 in
    median. APFL's CIFAR-10 (100 clients, 5 classes each, 49,757 of the 50,000 train samples, std 344) is
    this generator with ``users=100, classes_per_user=5, sigma=1.25``.
    """

    scheme: Literal["apfl_mnist"] = "apfl_mnist"
    users: int = Field(1000, ge=1, le=MAX_COUNT)
    classes_per_user: int = Field(2, ge=1, le=MAX_COUNT)
    first: int = Field(5, ge=0, le=MAX_SAMPLES)
    sigma: float = Field(2.0, gt=0, le=MAX_SIGMA)
    drop_remainder: bool = True

    def _split(self, labels: np.ndarray, n_clients: int, rng: np.random.Generator, groups) -> Parts:
        ranks, slot_class = self._slots(labels)
        class_sizes = np.bincount(ranks)
        holders = np.bincount(slot_class.ravel(), minlength=len(class_sizes))
        short = np.flatnonzero(class_sizes < self.first * holders)
        if len(short):
            c = short[0]
            raise ConfigError(
                f"partition.first: class {c} has {class_sizes[c]} samples, fewer than first * holders = "
                f"{self.first} * {holders[c]}"
            )
        rest = class_sizes - self.first * holders
        weights = rng.lognormal(0.0, self.sigma, slot_class.shape)
        if self.drop_remainder:
            total = _class_totals(slot_class, weights, len(class_sizes))
            bad = ~np.isfinite(total) | (total <= 0)
            if bad.any():
                # Draws that overflowed to inf or all underflowed to 0 would give 0/0 shares: such a class
                # goes by usable_weights instead (other classes are untouched).
                weights = weights.copy()
                for c in np.flatnonzero(bad):
                    weights[slot_class == c] = usable_weights(weights[slot_class == c])
                total = _class_totals(slot_class, weights, len(class_sizes))
            share = np.floor(weights / total[slot_class] * rest[slot_class]).astype(np.int64)
        else:
            share = np.zeros(slot_class.shape, dtype=np.int64)
            for c in range(len(class_sizes)):
                at = slot_class == c
                share[at] = largest_remainder(weights[at], int(rest[c]), rng)
        return self._assign(ranks, slot_class, share + self.first, rng)


class FEMNISTLognormal(_ClassCycleGenerator):
    """FedProx's FEMNIST (APFL's FEMNIST): 200 users, lower-case letters a-j, three consecutive letters each.

    Pass labels already relabelled 0-9 (see ``femnist_letters_a_to_j``). User u draws n_u = lognormal(mean,
    sigma) + ``offset`` and takes max(``min_per_class``, floor(n_u / classes_per_user)) samples of each of its
    classes, without replacement (the original reuses samples across users through an index-reset bug; here
    samples are disjoint). If a class has fewer samples than its users ask for, that class's requests are
    scaled down proportionally (floored; logged as a warning), which can leave users empty on small data.
    Samples nobody draws are dropped: this is a subsample, not a cover.
    """

    scheme: Literal["femnist_lognormal"] = "femnist_lognormal"
    users: int = Field(200, ge=1, le=MAX_COUNT)
    classes_per_user: int = Field(3, ge=1, le=MAX_COUNT)
    mean: float = Field(4.0, ge=-100, le=100)
    sigma: float = Field(1.0, gt=0, le=MAX_SIGMA)
    offset: float = Field(5.0, ge=0, le=MAX_SAMPLES)
    min_per_class: int = Field(2, ge=0, le=MAX_SAMPLES)

    def _split(self, labels: np.ndarray, n_clients: int, rng: np.random.Generator, groups) -> Parts:
        ranks, slot_class = self._slots(labels)
        n_u = rng.lognormal(self.mean, self.sigma, self.users) + self.offset
        # A request beyond int64 (an overflowed draw) is capped; the class scaling below shrinks it anyway.
        per_float = np.minimum(np.floor(n_u / self.classes_per_user), _MAX_REQUEST)
        per = np.maximum(self.min_per_class, per_float).astype(np.int64)
        take = np.repeat(per[:, None], self.classes_per_user, axis=1)
        supply = np.bincount(ranks)
        demand = np.bincount(slot_class.ravel(), weights=take.ravel(), minlength=len(supply))
        scale = np.minimum(1.0, supply / np.maximum(demand, 1))
        if scale.min() < 1:  # (per class: a total below the supply can still leave classes short)
            short = scale < 1
            log.warning(
                "femnist_lognormal: %d of %d classes are asked for more samples than they hold (%d asked, %d held); "
                "their requests scaled down, by up to %.3g",
                short.sum(),
                len(scale),
                demand[short].sum(),
                supply[short].sum(),
                scale.min(),
            )
        take = np.floor(take * scale[slot_class]).astype(np.int64)
        return self._assign(ranks, slot_class, take, rng)


def _class_totals(slot_class: np.ndarray, weights: np.ndarray, n_classes: int) -> np.ndarray:
    """Sum of the slot weights of each class (inf where the sum overflows)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.bincount(slot_class.ravel(), weights=weights.ravel(), minlength=n_classes)
