"""Natural partitions: one client per group id that the dataset itself provides."""

from __future__ import annotations

from typing import Literal

import numpy as np

from ...errors import ConfigError
from .base import PartitionScheme, Parts, fixed_clients, parts_from_owner


class Natural(PartitionScheme):
    """One client per distinct value of ``groups`` (FEMNIST writer, Vehicle sensor), in ascending id order.

    The client count is the number of distinct groups: pass ``n_clients=None`` or exactly that number. Every
    sample is assigned; no randomness is used.
    """

    scheme: Literal["natural"] = "natural"

    def num_clients(self, n_requested: int | None, groups: np.ndarray | None = None) -> int:
        return fixed_clients(
            n_requested, len(np.unique(self._groups(groups))), f"partition scheme '{self.scheme}'"
        )

    def _split(self, labels: np.ndarray, n_clients: int, rng: np.random.Generator, groups) -> Parts:
        groups = self._groups(groups)
        if len(groups) != len(labels):
            raise ConfigError(f"groups: has {len(groups)} entries but there are {len(labels)} labels")
        _, client = np.unique(groups, return_inverse=True)
        return parts_from_owner(client.astype(np.int64), n_clients)

    def _groups(self, groups: np.ndarray | None) -> np.ndarray:
        if groups is None:
            raise ConfigError(
                f"partition.scheme: '{self.scheme}' needs per-sample group ids, and this dataset has none; "
                "pick a synthetic scheme such as iid or dirichlet"
            )
        return np.asarray(groups).ravel()


class Domains(Natural):
    """One client per domain, for settings where each client is a whole dataset (AHF: Digits, Office-Caltech).

    Identical to ``natural``; it exists so configs say what they mean. The caller concatenates the domain
    datasets and passes the domain index of every sample as ``groups``.
    """

    scheme: Literal["domains"] = "domains"
