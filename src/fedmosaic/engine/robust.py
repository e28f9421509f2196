"""Robust aggregation, client-level differential privacy, server optimizers and simulated attacks: a stage on the
cohort's uploaded models around the algorithm's weighted mean of them (``ServerRuntime.aggregate``, the one place
every pool and a deployment pass through; docs/design.md "Robust aggregation").

Both act on each client's *update*, its uploaded model minus the model the server broadcast (``reference``), flat
over every parameter. The attack (``attack:``) replaces the uploads of a fixed set of clients, drawn once from the
run seed (the same Byzantine clients every round they are sampled), as they arrive; the stage (``aggregation:``)
then reduces the updates so that the algorithm's weighted mean of the rows it returns is the robust aggregate:

- ``norm_bound``: every update scaled to norm at most ``clip`` (weights kept);
- ``median`` / ``trimmed_mean``: every row replaced by the coordinate-wise median / mean after cutting
  ``floor(trim n)`` values at each end (unweighted, as Yin et al. 2018 and Flower's FedMedian/FedTrimmedAvg);
- ``krum``: Multi-Krum (Blanchard et al. 2017): each update's score is the sum of squared distances to its
  n - f - 2 nearest others; the ``m`` lowest keep their weights, the rest get weight 0 (m = 1: Krum);
- ``bulyan`` (El Mhamdi et al. 2018, as Flower's): Krum chooses n - 2f updates one after another, then every row
  becomes per coordinate the mean of the n - 4f chosen values closest to their median.

``privacy:`` replaces the rule with DP-FedAvg's clipped, noised mean (:func:`private`; its accounting:
``accounting.py``); ``aggregation.optimizer`` then steps from the broadcast model along the aggregate's change
(:func:`server_step`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import ConfigError
from ..protocol.algorithm import Algorithm
from .accounting import accountant
from .seeding import rng

if TYPE_CHECKING:
    from .settings import RoundSettings

ATTACK, DP_NOISE, DP_LOCAL = 15, 16, 17  # seeding streams: the attackers' choice and their noise; privacy noise
NOISE = 4  # the attack noise's key under ATTACK, which shares PARTICIPATION's number (sub-keys 1-3: seeding.py)


def eligible(algo: type[Algorithm]) -> bool:
    """The algorithm's server step is the default weighted mean of uploaded models (DP-FedAvg's precondition)."""
    return bool(algo.global_model) and algo.aggregate is Algorithm.aggregate


def averaged(algo: type[Algorithm]) -> tuple[str, str] | None:
    """(upload key, server-state key) of the weighted mean the algorithm's server step is (``Algorithm.averages``),
    or None: what a rule, an upload attack and a server optimizer act on."""
    if eligible(algo):
        return "model", "model"

    def owner(name: str) -> int:  # the most derived class that defines it, as its place in the MRO
        return next(i for i, c in enumerate(algo.__mro__) if name in c.__dict__)
    return algo.averages if owner("averages") <= owner("aggregate") else None  # (with its aggregate, or below)


def check(s: RoundSettings, algo: type[Algorithm], tasks: bool, cohort: int, extra: bool = True) -> None:
    """One line, before anything runs, when the stage or the attack does not apply to the algorithm or to the
    ``cohort`` (the clients a round samples: ``train.clients_per_round``, or fewer where fewer train); ``extra``:
    and when privacy's accountant is not installed (a config read to report finished runs does not need it)."""
    agg, attack = s.aggregation, s.attack
    active = agg is not None and agg.rule != "mean"
    opt = agg is not None and agg.optimizer != "none"
    if attack is not None and attack.kind == "label_flip":
        if tasks:
            raise ConfigError("attack: label_flip on a class-incremental stream would move samples out of their "
                              "task's classes; flip labels on a stream of one task, or choose another attack")
        attack = None  # (poisoned data, honest training: defined for every algorithm)
    if (active or opt or attack is not None) and averaged(algo) is None:
        what = f"aggregation: {agg.rule}" if active else f"aggregation.optimizer: {agg.optimizer}" if opt else \
            f"attack: {attack.kind}"
        raise ConfigError(f"{what}: algorithm {algo.name!r} does not average uploaded models (its server step is its "
                          "own), so neither a robust stage nor an upload attack is defined for it; algorithms it "
                          "applies to: those whose server takes a weighted mean of (part of) the clients' models "
                          "(e.g. fedavg, fedprox, fedntd, ditto, pfedsrb, fedbn, fedper)")
    if s.privacy is not None:
        if not eligible(algo):
            raise ConfigError(f"privacy: algorithm {algo.name!r} does not average uploaded models, so DP-FedAvg's "
                              "clipped, noised mean is not defined for it")
        if active and s.privacy.mode != "local":
            raise ConfigError(f"privacy: DP-FedAvg is its own aggregation (clipped updates, their mean, noise); "
                              f"aggregation.rule {agg.rule} cannot be combined with it (a server optimizer can, and "
                              "a rule can after privacy.mode: local)")
        if extra:
            accountant()  # the extra, in one line, before anything runs
    given = f"a round samples {cohort}" + ("" if cohort == s.train.clients_per_round else
                                             f" of train.clients_per_round {s.train.clients_per_round}: only "
                                             f"{cohort} clients train (participation.held_out)")
    if active and agg.rule == "krum" and cohort <= 2 * agg.f + 2:
        raise ConfigError(f"aggregation: krum with f = {agg.f} needs more than 2f + 2 = {2 * agg.f + 2} clients a "
                          f"round ({given})")
    if active and agg.rule == "bulyan" and cohort < 4 * agg.f + 3:
        raise ConfigError(f"aggregation: bulyan with f = {agg.f} needs at least 4f + 3 = {4 * agg.f + 3} clients a "
                          f"round ({given})")
    if active and agg.rule == "trimmed_mean" and trimmed(agg.trim, cohort) < 1:
        raise ConfigError(f"aggregation: trimmed_mean with trim = {agg.trim:g} cuts floor(trim x {cohort}) = 0 "
                          f"updates at each end ({given}): a plain mean, which one update moves as far as it likes; "
                          f"set trim >= {1 / cohort:.3g}, or rule: median")
    if active and agg.rule == "krum" and agg.m > cohort - agg.f:
        raise ConfigError(f"aggregation: krum keeps m = {agg.m} updates, more than the n - f = {cohort - agg.f} it "
                          f"can trust ({given})")


def short(s: RoundSettings, n: int) -> str | None:
    """Why the rule cannot judge the ``n`` updates that arrived (fewer than it needs for its ``f``, or too few for
    the trimmed mean to cut one: clients that dropped out or withheld their replies), or None. ``check`` holds the
    configured cohort to the same bounds; this holds the round's actual one, since the rules' guarantees need them
    of the updates they see (with n <= 4f Bulyan's trimmed mean is over no value at all)."""
    agg = s.aggregation
    rule = None if agg is None else agg.rule
    if rule == "krum" and n <= 2 * agg.f + 2:
        return f"krum with f = {agg.f} needs more than 2f + 2 = {2 * agg.f + 2} updates, {n} arrived"
    if rule == "bulyan" and n < 4 * agg.f + 3:
        return f"bulyan with f = {agg.f} needs at least 4f + 3 = {4 * agg.f + 3} updates, {n} arrived"
    if rule == "trimmed_mean" and trimmed(agg.trim, n) < 1:
        return f"trimmed_mean with trim = {agg.trim:g} cuts nothing of {n} updates (a plain mean)"
    return None


def trimmed(trim: float, n: int) -> int:
    """How many of ``n`` values the trimmed mean cuts at each end."""
    return int(trim * n)


def attackers(num_clients: int, fraction: float, seed: int) -> np.ndarray:
    """The attacking clients' ids (sorted): ceil(fraction K) of the K clients, drawn once from the run seed."""
    k = min(num_clients, math.ceil(fraction * num_clients - 1e-9))
    return np.sort(rng(seed, ATTACK).choice(num_clients, size=k, replace=False))


def flip_labels(s: RoundSettings, train, num_classes: int):
    """``train`` (a ``ClientTensors`` split) with the attackers' labels flipped, y -> C - 1 - y, when the attack is
    ``label_flip`` (else ``train`` itself): poisoned data that every pool's clients then train on honestly."""
    a = s.attack
    if a is None or a.kind != "label_flip":
        return train
    bad = attackers(len(train.ptr) - 1, a.fraction, s.seed)
    rows = np.concatenate([np.arange(train.ptr[k], train.ptr[k + 1]) for k in bad])
    y = train.y.clone()
    at = torch.as_tensor(rows, device=y.device)
    y[at] = num_classes - 1 - y[at]
    return dataclasses.replace(train, y=y)


def _flat(stacked: dict, reference: dict) -> tuple[torch.Tensor, list]:
    keys = sorted(stacked)
    rows = torch.cat([(stacked[k] - reference[k]).flatten(1) for k in keys], dim=1)
    return rows, keys


def _clip(delta: torch.Tensor, norm: torch.Tensor, c: float) -> torch.Tensor:
    """Each row of ``delta`` (its ``norm`` [n, 1]) scaled to norm at most ``c`` (a zero row stays zero)."""
    return delta * torch.clamp(c / norm.clamp(min=1e-30), max=1.0)


def _client_noise(seed: int, stream: tuple, round_idx: int, clients, like: torch.Tensor) -> torch.Tensor:
    """Standard normal rows [len(clients), like's width], each seeded by (seed, *stream, round, client): a client's
    noise is its own, whoever else is in the cohort and on whichever pool or node it is drawn."""
    return torch.stack([torch.as_tensor(rng(seed, *stream, round_idx, int(c)).standard_normal(like.shape[1]),
                                        dtype=like.dtype) for c in clients]).to(like.device)


def _put(stacked: dict, reference: dict, keys: list, rows: torch.Tensor, delta: torch.Tensor) -> dict:
    """``stacked`` with the clients ``rows`` replaced by reference + their new flat ``delta`` (the other rows left
    bit for bit as they came)."""
    out, at = dict(stacked), 0
    for k in keys:
        size = reference[k].numel()
        new = (reference[k] + delta[:, at : at + size].reshape(len(rows), *reference[k].shape)).to(stacked[k].dtype)
        out[k] = stacked[k].index_copy(0, rows, new)
        at += size
    return out


def attack(s: RoundSettings, stacked: dict, reference: dict, cohort: np.ndarray, round_idx: int,
           num_clients: int) -> dict:
    """The uploads with the attackers' rows replaced (``attack``; unchanged without one)."""
    a = s.attack
    if a is None or a.kind == "label_flip":  # (label_flip poisons the data: :func:`flip_labels`)
        return stacked
    bad = np.isin(cohort, attackers(num_clients, a.fraction, s.seed))
    if not bad.any():
        return stacked
    delta, keys = _flat(stacked, reference)
    rows = torch.as_tensor(np.flatnonzero(bad), device=delta.device)
    d = delta[rows]
    if a.kind == "scale":
        d = d * a.factor
    elif a.kind == "sign_flip":
        d = -a.factor * d
    elif a.kind == "noise":
        d = d + a.sigma * _client_noise(s.seed, (ATTACK, NOISE), round_idx, cohort[bad], delta)
    else:  # free_rider: the broadcast model sent back
        d = torch.zeros_like(d)
    return _put(stacked, reference, keys, rows, d)


def aggregate(s: RoundSettings, stacked: dict, reference: dict, weights: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """The rows and weights whose weighted mean is the robust aggregate (``aggregation``)."""
    agg = s.aggregation
    if agg is None or agg.rule == "mean":
        return stacked, weights
    delta, keys = _flat(stacked, reference)
    n = delta.shape[0]
    if agg.rule == "norm_bound":  # only the rows above the bound change
        norm = delta.norm(dim=1)
        rows = torch.nonzero(norm > agg.clip).flatten()
        return _put(stacked, reference, keys, rows, delta[rows] * (agg.clip / norm[rows])[:, None]), weights
    if agg.rule in ("median", "trimmed_mean"):
        s = delta.sort(dim=0).values
        if agg.rule == "median":
            row = (s[(n - 1) // 2] + s[n // 2]) / 2
        else:
            cut = trimmed(agg.trim, n)
            row = s[cut : n - cut].mean(0)
        return _put(stacked, reference, keys, torch.arange(n, device=delta.device), row.expand(n, -1)), weights
    dist = torch.cdist(delta.double(), delta.double()).pow(2)
    if agg.rule == "bulyan":  # Krum picks n - 2f updates one after another; then a trimmed mean around their median
        left, chosen = list(range(n)), []
        for _ in range(n - 2 * agg.f):
            chosen.append(left.pop(int(torch.argsort(_krum_scores(dist[left][:, left], agg.f), stable=True)[0])))
        sel = delta[chosen]
        s = sel.sort(dim=0).values
        k = len(chosen)
        med = (s[(k - 1) // 2] + s[k // 2]) / 2
        near = torch.argsort((sel - med).abs(), dim=0, stable=True)[: k - 2 * agg.f]
        row = sel.gather(0, near).mean(0)
        return _put(stacked, reference, keys, torch.arange(n, device=delta.device), row.expand(n, -1)), weights
    # krum: the m updates of lowest score keep their weights
    keep = torch.zeros(n, dtype=torch.bool, device=delta.device)
    keep[torch.argsort(_krum_scores(dist, agg.f), stable=True)[: min(agg.m, n)]] = True
    kept = torch.where(keep, weights, torch.zeros_like(weights))
    return stacked, kept if bool(kept.sum() > 0) else keep.to(weights.dtype)  # (kept clients without samples)


def _krum_scores(dist: torch.Tensor, f: int) -> torch.Tensor:
    """Krum's score of each of n updates from their squared distances [n, n]: the sum of the distances to its
    n - f - 2 nearest others (at least one)."""
    near = max(dist.shape[0] - f - 2, 1)
    return dist.sort(dim=1).values[:, 1 : near + 1].sum(1)  # (column 0: the distance to itself)


#: the defaults per server optimizer: eta, beta1, beta2, tau (Flower 1.42's; avgm's momentum 0.9 is fedavgm's and
#: Hsu et al.'s, where Flower's FedAvgM defaults to none)
OPTIMIZERS = {"adam": (0.1, 0.9, 0.99, 1e-9), "yogi": (0.01, 0.9, 0.99, 1e-3), "adagrad": (0.1, 0.0, 0.0, 1e-9),
              "avgm": (1.0, 0.9, 0.0, 0.0)}


def server_step(s: RoundSettings, state: dict | None, current: dict, aggregate: dict,
                round_idx: int) -> tuple[dict, dict]:
    """The global model after a server optimizer step on the pseudo-gradient ``aggregate - current`` (the
    algorithm's aggregate minus the model it broadcast) and the optimizer's new moments ``{"m", "v"}`` (``state``
    None: zeros). The rules of Flower's FedAdam (its bias-corrected rate with server_round + 1, server_round
    counting from 1), FedYogi, FedAdagrad (m is the update itself: no momentum) and FedAvgM (SGD with heavy-ball
    momentum: m <- beta1 m + update, w <- w + eta m; the algorithm fedavgm's rule)."""
    agg = s.aggregation
    eta, b1, b2, tau = (d if v is None else v for v, d in zip((agg.eta, agg.beta1, agg.beta2, agg.tau),
                                                             OPTIMIZERS[agg.optimizer], strict=True))
    if agg.optimizer == "adagrad":
        b1 = 0.0
    delta = {k: aggregate[k] - current[k] for k in aggregate}
    m0 = state["m"] if state else {k: torch.zeros_like(d) for k, d in delta.items()}
    if agg.optimizer == "avgm":
        m = {k: b1 * m0[k] + d for k, d in delta.items()}
        return {k: current[k] + eta * m[k] for k in current}, {"m": m, "v": {}}
    v0 = state["v"] if state else {k: torch.zeros_like(d) for k, d in delta.items()}
    m = {k: b1 * m0[k] + (1 - b1) * d for k, d in delta.items()}
    if agg.optimizer == "adam":
        v = {k: b2 * v0[k] + (1 - b2) * d * d for k, d in delta.items()}
        flower_round = round_idx + 1
        eta = eta * math.sqrt(1 - b2 ** (flower_round + 1.0)) / (1 - b1 ** (flower_round + 1.0))
    elif agg.optimizer == "yogi":
        v = {k: v0[k] - (1 - b2) * d * d * torch.sign(v0[k] - d * d) for k, d in delta.items()}
    else:
        v = {k: v0[k] + d * d for k, d in delta.items()}
    new = {k: current[k] + eta * m[k] / (v[k].sqrt() + tau) for k in current}
    return new, {"m": m, "v": v}


def private(s: RoundSettings, stacked: dict, reference: dict, round_idx: int,
            clip: float | None = None) -> tuple[dict, float]:
    """DP-FedAvg's aggregate (central) as rows that all hold it, and the clip for the next round: every update
    clipped to norm C (``clip``, default ``privacy.clip``), their uniform mean, plus Gaussian noise of std
    sigma_u C / m (m: the cohort's size; seeded by the round). With ``privacy.adaptive`` (Andrew et al. 2021) the
    next C is C exp(-lr (b - quantile)), b the noised fraction of updates left unclipped, and the budget is shared:
    sigma_u = (sigma^-2 - (2 count_noise)^-2)^-1/2, so the pair accounts as one Gaussian of multiplier sigma."""
    p, a = s.privacy, s.privacy.adaptive
    c = p.clip if clip is None else clip
    delta, keys = _flat(stacked, reference)
    n = delta.shape[0]
    norm = delta.norm(dim=1, keepdim=True)
    clipped = _clip(delta, norm, c)
    sigma = p.noise if a is None or p.noise == 0 else (p.noise ** -2 - (2 * a.count_noise) ** -2) ** -0.5
    noise = torch.as_tensor(rng(s.seed, DP_NOISE, round_idx).standard_normal(delta.shape[1]), dtype=delta.dtype)
    row = clipped.mean(0) + (sigma * c / n) * noise.to(delta.device)
    rows = _put(stacked, reference, keys, torch.arange(n, device=delta.device), row.expand(n, -1))
    if a is None:
        return rows, c
    unclipped = float((norm <= c).sum()) + a.count_noise * float(rng(s.seed, DP_NOISE, round_idx, 1).standard_normal())
    return rows, c * math.exp(-a.lr * (unclipped / n - a.quantile))


def local(s: RoundSettings, uploads: dict, reference: dict, clients: np.ndarray, round_idx: int) -> dict:
    """``privacy.mode: local``, on the client before it uploads: each client's update clipped to norm C and
    Gaussian noise of std sigma C added (seeded by round and client: the same on every pool and on its node)."""
    p = s.privacy
    delta, keys = _flat(uploads["model"], reference)
    clipped = _clip(delta, delta.norm(dim=1, keepdim=True), p.clip)
    noise = _client_noise(s.seed, (DP_LOCAL,), round_idx, clients, delta)
    rows = torch.arange(len(clients), device=delta.device)
    return {**uploads, "model": _put(uploads["model"], reference, keys, rows, clipped + p.noise * p.clip * noise)}
