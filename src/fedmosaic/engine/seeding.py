"""Every random choice comes from a generator derived from (run seed, stream, round, client), so cohorts and batch
orders are the same for every algorithm, backend and chunk size."""

from __future__ import annotations

import numpy as np

(COHORT, BATCHES, INIT, AUGMENT, VIEWS, FINETUNE, POOL, WARMUP, PUBLIC, SERVER, TASKS, MEMORY,
 TASK_END, CONTINUAL_EVAL, PARTICIPATION) = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15
#: (robust.py's ATTACK, DP_NOISE, DP_LOCAL are 15, 16, 17: ATTACK shares PARTICIPATION's number, kept so that the
#: attack results of docs/results.md reproduce: the attackers are (15), participation's draws (15, 1 | 2 | 3, ...)
#: and the attack noise (15, 4, ...), so no two keys coincide. A new stream takes a new number.)
FORWARD = 18


def rng(seed: int, stream: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), stream, *(int(k) for k in keys)])


def forward_seed(seed: int, round_idx: int, keys: tuple, client: int, step: int) -> int:
    """The torch seed of one client's training steps of a phase from ``step`` on (the step at which the per-client
    loop takes it over: 0 on the sequential path), for a model that draws random numbers there (dropout): the same
    whatever other clients train, in this process or another."""
    return int(rng(seed, FORWARD, round_idx, *keys, client, step).integers(2**62))


def sample_cohort(num_clients: int, per_round: int, seed: int, round_idx: int,
                  among: np.ndarray | None = None) -> np.ndarray:
    """Clients of round ``round_idx`` (sorted), sampled uniformly without replacement from all ``num_clients``
    or from the client ids ``among``."""
    pool = num_clients if among is None else len(among)
    picked = rng(seed, COHORT, round_idx).choice(pool, size=min(per_round, pool), replace=False)
    return np.sort(picked if among is None else np.asarray(among)[picked])


def held_out_count(num_clients: int, fraction: float) -> int:
    """How many of ``num_clients`` never train: ``fraction`` of them, at least one when it is above 0, never all."""
    return 0 if fraction <= 0 or num_clients < 2 else min(num_clients - 1, max(1, round(fraction * num_clients)))


def held_out(num_clients: int, fraction: float, seed: int) -> np.ndarray:
    """The clients that never train (sorted; :func:`held_out_count` of them), drawn once from the run seed."""
    n = held_out_count(num_clients, fraction)
    if not n:
        return np.zeros(0, dtype=np.int64)
    return np.sort(rng(seed, PARTICIPATION, 2).choice(num_clients, size=n, replace=False))


def drop_out(chosen: np.ndarray, rate: float, num_clients: int, seed: int, round_idx: int) -> np.ndarray:
    """The ``chosen`` clients of round ``round_idx`` that answer: each drops with chance ``rate``, by a draw of its
    own (one per client of the federation: the same whichever others were chosen); if all dropped, the one with
    the lowest draw stays."""
    if rate <= 0 or not len(chosen):
        return chosen
    u = rng(seed, PARTICIPATION, 1, round_idx).random(num_clients)[chosen]
    kept = chosen[u >= rate]
    return kept if len(kept) else chosen[[int(np.argmin(u))]]


def work_shares(clients: np.ndarray, rate: float, seed: int, round_idx: int) -> np.ndarray | None:
    """Per client of round ``round_idx`` the share of its local steps it runs: 1, or for a straggler (chance
    ``rate``, a draw of its own) a share drawn uniformly in (0, 1]. None: no stragglers."""
    if rate <= 0:
        return None
    draws = np.array([rng(seed, PARTICIPATION, 3, round_idx, int(k)).random(2) for k in clients]).reshape(-1, 2)
    return np.where(draws[:, 0] < rate, 1.0 - draws[:, 1], 1.0)


def batch_plan(counts: np.ndarray, clients: np.ndarray, epochs: int, batch: int, seed: int, round_idx: int,
               keys: tuple[int, ...] = (), steps: int | np.ndarray | None = None):
    """Local batch schedule of each client: a fresh permutation per epoch, cut into batches (last one partial).

    ``counts[i]``: the samples client ``clients[i]`` draws from (its train split, or a view of it); ``keys`` tell
    apart the several schedules a client may have in one round (phases, paired batches); the first phase's schedule
    has none. With ``steps`` (one count, or one per client), a client takes exactly that many steps (as many epochs as needed,
    cut there); a client with nothing to draw from takes none.
    Returns ``positions [n, S, B]`` (offsets into what the client draws from), ``valid [n, S, B]`` and ``steps [n]``;
    S is the longest client's step count, shorter clients are padded (their extra steps never run).
    """
    n = len(clients)
    counts = np.asarray(counts, dtype=np.int64)
    per_epoch = -(-counts // batch)  # ceil
    n_steps = per_epoch * epochs if steps is None else np.where(counts > 0, steps, 0)
    S = int(n_steps.max()) if n else 0
    positions = np.zeros((n, S, batch), dtype=np.int64)
    valid = np.zeros((n, S, batch), dtype=bool)
    for i, k in enumerate(clients):
        nk = int(counts[i])
        if nk == 0:
            continue
        g = rng(seed, BATCHES, round_idx, k, *keys)
        pe = int(per_epoch[i])
        m = int(n_steps[i])
        reps = epochs if steps is None else max(1, -(-m // pe))
        order = np.concatenate([g.permutation(nk) for _ in range(reps)])
        # pad each epoch to a whole number of batches so batches never straddle epochs
        padded = np.zeros((reps, pe * batch), dtype=np.int64)
        mask = np.zeros((reps, pe * batch), dtype=bool)
        padded[:, :nk] = order.reshape(reps, nk)
        mask[:, :nk] = True
        positions[i, :m] = padded.reshape(-1, batch)[:m]
        valid[i, :m] = mask.reshape(-1, batch)[:m]
    return positions, valid, n_steps
