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
        return fixed_clients(n_requested, len(self._ids(groups)[0]), f"partition scheme '{self.scheme}'")

    def _split(self, labels: np.ndarray, n_clients: int, rng: np.random.Generator, groups) -> Parts:
        _, client = self._ids(groups)
        if len(client) != len(labels):
            raise ConfigError(f"groups: has {len(client)} entries but there are {len(labels)} labels")
        return parts_from_owner(client, n_clients)

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

    Identical to ``natural``; it exists so configs say what they mean. The caller concatenates the domain
    datasets and passes the domain index of every sample as ``groups``.
    """

    scheme: Literal["domains"] = "domains"
