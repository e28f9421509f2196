"""Every random choice comes from a generator derived from (run seed, stream, round, client), so cohorts and batch
orders are the same for every algorithm, backend and chunk size."""

from __future__ import annotations

import numpy as np

COHORT, BATCHES, INIT, AUGMENT = 1, 2, 3, 4


def rng(seed: int, stream: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), stream, *(int(k) for k in keys)])


def sample_cohort(num_clients: int, per_round: int, seed: int, round_idx: int) -> np.ndarray:
    """Clients of round ``round_idx`` (sorted), sampled uniformly without replacement."""
    m = min(per_round, num_clients)
    return np.sort(rng(seed, COHORT, round_idx).choice(num_clients, size=m, replace=False))


def batch_plan(sizes: np.ndarray, clients: np.ndarray, epochs: int, batch: int, seed: int, round_idx: int):
    """Local batch schedule of each client: a fresh permutation per epoch, cut into batches (last one partial).

    Returns ``positions [n, S, B]`` (offsets inside the client's train range), ``valid [n, S, B]`` and ``steps [n]``;
    S is the longest client's step count, shorter clients are padded (their extra steps never run).
    """
    n = len(clients)
    per_epoch = -(-sizes[clients] // batch)  # ceil
    steps = per_epoch * epochs
    S = int(steps.max()) if n else 0
    positions = np.zeros((n, S, batch), dtype=np.int64)
    valid = np.zeros((n, S, batch), dtype=bool)
    for i, k in enumerate(clients):
        nk = int(sizes[k])
        if nk == 0:
            continue
        g = rng(seed, BATCHES, round_idx, k)
        order = np.concatenate([g.permutation(nk) for _ in range(epochs)])
        # pad each epoch to a whole number of batches so batches never straddle epochs
        pe = int(per_epoch[i])
        padded = np.zeros((epochs, pe * batch), dtype=np.int64)
        mask = np.zeros((epochs, pe * batch), dtype=bool)
        padded[:, :nk] = order.reshape(epochs, nk)
        mask[:, :nk] = True
        positions[i, : pe * epochs] = padded.reshape(-1, batch)
        valid[i, : pe * epochs] = mask.reshape(-1, batch)
    return positions, valid, steps
