"""Natural partitions: one client per group id that the dataset itself provides."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, field_validator

from ...errors import ConfigError
from .base import MAX_SAMPLES, PartitionScheme, Parts, fixed_clients, parts_from_owner


class Natural(PartitionScheme):
    """One client per distinct value of ``groups`` (FEMNIST writer, Vehicle sensor), in ascending id order.

    The client count is the number of distinct groups: pass ``n_clients=None`` or exactly that number. Every
    sample is assigned; no randomness is used.
    """

    scheme: Literal["natural"] = "natural"

    def num_clients(self, n_requested: int | None, groups: np.ndarray | None = None) -> int:
        return fixed_clients(n_requested, len(self._ids(groups)[0]), f"partition scheme '{self.scheme}'")

    def _split(self, labels: np.ndarray, n_clients: int, rng: np.random.Generator, groups) -> Parts:
        _, client = self._ids(groups)
        if len(client) != len(labels):
            raise ConfigError(f"groups: has {len(client)} entries but there are {len(labels)} labels")
        return parts_from_owner(client, n_clients)

    def test_parts(self, groups_train: np.ndarray, groups_test: np.ndarray, rng: np.random.Generator) -> Parts:
        """Each client's own test samples: those of its group (LEAF's per-writer split)."""
        ids = self._ids(groups_train)[0]
        return [np.flatnonzero(groups_test == g) for g in ids]

    def _ids(self, groups: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The distinct group ids ascending, and each sample's client (the rank of its id)."""
        if groups is None:
            raise ConfigError(
                f"partition.scheme: '{self.scheme}' needs per-sample group ids, and this dataset has none; "
                "pick a synthetic scheme such as iid or dirichlet"
            )
        try:
            ids, client = np.unique(np.asarray(groups).ravel(), return_inverse=True)
        except (TypeError, ValueError):
            raise ConfigError("groups: must be an array of comparable ids (numbers or strings)") from None
        if len(ids) == 0:
            raise ConfigError("groups: empty; a natural partition needs at least one group id")
        return ids, client.reshape(-1).astype(np.int64)


class Domains(Natural):
    """One client per domain, for settings where each client is a whole dataset (AHF: Digits, Office-Caltech).

    ``natural`` with optional private sizes: ``sizes`` [per domain] keeps that many of the domain's train samples
    (a seeded random subset; AHF's Digits: 150 / 100 / 5000 / 2000), ``test_sizes`` the same for its test samples
    (where the dataset has a test split per domain). A size above what the domain has keeps all of it.
    """

    scheme: Literal["domains"] = "domains"
    sizes: list[int] | None = Field(None, min_length=1)
    test_sizes: list[int] | None = Field(None, min_length=1)

    @field_validator("sizes", "test_sizes")
    @classmethod
    def _positive(cls, v):
        if v is not None and any(n < 1 or n > MAX_SAMPLES for n in v):
            raise ValueError(f"must be sample counts in [1, {MAX_SAMPLES}] (got {v})")
        return v

    def _split(self, labels, n_clients, rng, groups) -> Parts:
        return self._cut(super()._split(labels, n_clients, rng, groups), self.sizes, "sizes", rng)

    def test_parts(self, groups_train, groups_test, rng) -> Parts:
        return self._cut(super().test_parts(groups_train, groups_test, rng), self.test_sizes, "test_sizes", rng)

    @staticmethod
    def _cut(parts: Parts, sizes: list[int] | None, what: str, rng) -> Parts:
        if sizes is None:
            return parts
        if len(sizes) != len(parts):
            raise ConfigError(f"partition.{what}: one size per domain, {len(parts)} domains (got {len(sizes)} sizes)")
        return [np.sort(rng.choice(p, size=n, replace=False)) if n < len(p) else p
                for p, n in zip(parts, sizes, strict=True)]
