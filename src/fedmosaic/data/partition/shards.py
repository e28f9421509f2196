"""Label shards (McMahan et al.; FedNTD): every client gets ``s`` label-sorted shards."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from ...errors import ConfigError
from .base import PartitionScheme, Parts, as_labels, class_members, even_sizes, parts_from_owner


class Shards(PartitionScheme):
    """Sort by label, cut each class into ``s*K/C`` equal shards, deal ``s`` shards to each client.

    The shard-label table (which labels each client's shards carry) is a random permutation of the multiset
    "class c repeated s*K/C times", reshaped to K x s. Within a class the shards are contiguous runs of the
    class's indices in dataset order; when the class size is not a multiple of its shard count the first
    shards get one leftover sample each. Every sample is assigned. When s*K is not a multiple of C, the
    (s*K mod C) classes chosen at random get one shard more than the rest. ``split_paired`` cuts the test
    set with the same table, so each client's test shards carry the labels of its train shards.
    """

    scheme: Literal["shards"] = "shards"
    shards_per_client: int = Field(2, ge=1)

    def _split(self, labels: np.ndarray, n_clients: int, rng: np.random.Generator, groups) -> Parts:
        table = self._table(np.unique(labels), n_clients, rng)
        return _deal(labels, table, rng, "train")

    def split_paired(self, train_labels, test_labels, n_clients, rng, groups=None) -> tuple[Parts, Parts]:
        train_labels, test_labels = as_labels(train_labels), as_labels(test_labels)
        n_clients = self.num_clients(n_clients, groups)
        table = self._table(np.unique(train_labels), n_clients, rng)
        return _deal(train_labels, table, rng, "train"), _deal(test_labels, table, rng, "test")

    def _table(self, classes: np.ndarray, n_clients: int, rng: np.random.Generator) -> np.ndarray:
        s, total = self.shards_per_client, self.shards_per_client * n_clients
        if total < len(classes):
            raise ConfigError(
                f"partition.shards_per_client: shards_per_client * n_clients = {s} * {n_clients} = {total} "
                f"is fewer than the {len(classes)} classes; every class needs at least one shard"
            )
        per_class = np.full(len(classes), total // len(classes))
        per_class[rng.permutation(len(classes))[: total % len(classes)]] += 1
        return rng.permutation(np.repeat(classes, per_class)).reshape(n_clients, s)


def _deal(labels: np.ndarray, table: np.ndarray, rng: np.random.Generator, which: str) -> Parts:
    n_clients = table.shape[0]
    shards_of = np.bincount(table.ravel())
    members = class_members(labels, max(len(shards_of), int(labels.max(initial=-1)) + 1))
    owner = np.full(len(labels), -1, dtype=np.int64)
    for c, idx in enumerate(members):
        m = int(shards_of[c]) if c < len(shards_of) else 0
        if m == 0:
            if len(idx):
                raise ConfigError(f"partition.shards: {which} class {c} does not occur in the train labels")
            continue
        if len(idx) < m:
            raise ConfigError(
                f"partition.shards_per_client: {which} class {c} has {len(idx)} samples, fewer than its {m} "
                "shards; lower shards_per_client or n_clients"
            )
        holders = np.flatnonzero(table == c) // table.shape[1]
        owner[idx] = np.repeat(holders[rng.permutation(m)], even_sizes(len(idx), m))
    return parts_from_owner(owner, n_clients)
