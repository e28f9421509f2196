"""Label shards (McMahan et al.; FedNTD): every client gets ``s`` label-sorted shards."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from ...errors import ConfigError
from .base import (
    MAX_COUNT,
    PartitionScheme,
    Parts,
    as_labels,
    class_members,
    class_ranks,
    even_sizes,
    parts_from_owner,
)


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
    shards_per_client: int = Field(2, ge=1, le=MAX_COUNT)

    def _split(self, labels: np.ndarray, n_clients: int, rng: np.random.Generator, groups) -> Parts:
        table = self._table(labels, n_clients, rng)
        return _deal(labels, table, rng, "train")

    def split_paired(self, train_labels, test_labels, n_clients, rng, groups=None) -> tuple[Parts, Parts]:
        train_labels, test_labels = as_labels(train_labels), as_labels(test_labels)
        n_clients = self.num_clients(n_clients, groups)
        table = self._table(train_labels, n_clients, rng)
        return _deal(train_labels, table, rng, "train"), _deal(test_labels, table, rng, "test")

    def _table(self, labels: np.ndarray, n_clients: int, rng: np.random.Generator) -> np.ndarray:
        classes = np.unique(labels)
        s, total = self.shards_per_client, self.shards_per_client * n_clients
        # Every shard needs a sample. Checked before the table is built, so a huge n_clients or
        # shards_per_client is an error rather than a huge allocation; a split this rejects would have failed
        # the per-class check in _deal anyway.
        if total > len(labels):
            raise ConfigError(
                f"partition.shards_per_client: shards_per_client * n_clients = {s} * {n_clients} = {total} "
                f"shards need at least one sample each, but there are only {len(labels)} samples"
            )
        if total < len(classes):
            raise ConfigError(
                f"partition.shards_per_client: shards_per_client * n_clients = {s} * {n_clients} = {total} "
                f"is fewer than the {len(classes)} classes; every class needs at least one shard"
            )
        per_class = np.full(len(classes), total // len(classes))
        per_class[rng.permutation(len(classes))[: total % len(classes)]] += 1
        return rng.permutation(np.repeat(classes, per_class)).reshape(n_clients, s)


def _deal(labels: np.ndarray, table: np.ndarray, rng: np.random.Generator, which: str) -> Parts:
    """Cut each class's samples into its shards and give shard j of class c to the j-th holder of c.

    Classes are visited in ascending label value (those with neither samples nor shards take no randomness),
    and a class's holders are its positions in ``table`` in row-major order.
    """
    n_clients, s = table.shape
    classes, ranks, _ = class_ranks(labels)
    members = class_members(ranks, len(classes))
    flat = table.ravel()
    slot_order = np.argsort(flat, kind="stable")  # each class's table positions, ascending
    table_classes, shard_counts = np.unique(flat, return_counts=True)
    slot_start = np.concatenate([[0], np.cumsum(shard_counts)])
    owner = np.full(len(labels), -1, dtype=np.int64)
    for c in np.union1d(classes, table_classes):
        i = int(np.searchsorted(classes, c))
        idx = members[i] if i < len(classes) and classes[i] == c else np.zeros(0, dtype=np.int64)
        j = int(np.searchsorted(table_classes, c))
        m = int(shard_counts[j]) if j < len(table_classes) and table_classes[j] == c else 0
        if m == 0:
            raise ConfigError(f"partition.shards: {which} class {c} does not occur in the train labels")
        if len(idx) < m:
            raise ConfigError(
                f"partition.shards_per_client: {which} class {c} has {len(idx)} samples, fewer than its {m} "
                "shards; lower shards_per_client or n_clients"
            )
        holders = slot_order[slot_start[j] : slot_start[j + 1]] // s
        owner[idx] = np.repeat(holders[rng.permutation(m)], even_sizes(len(idx), m))
    return parts_from_owner(owner, n_clients)
