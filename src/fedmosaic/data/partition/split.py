"""Per-client stratified train/test/val split (pFedSRB/PFLlib 75/25, FedProx 90/10, CIFAR-10 APFL 80/20)."""

from __future__ import annotations

import math

import numpy as np

from ...errors import ConfigError
from .base import Parts, as_labels, largest_remainder, shown

HOLDOUTS = ("test", "val")


def client_split(
    labels: np.ndarray, parts: Parts, fractions: dict[str, float], rng: np.random.Generator
) -> dict[str, Parts]:
    """Split every client's indices into ``train``, ``test`` and ``val`` parts, stratified by class.

    ``fractions`` gives the held-out shares, e.g. ``{"test": 0.25}`` or ``{"test": 0.1, "val": 0.1}``; a
    missing key means 0 (its parts are empty). A client of n samples holds out ceil(f * n) samples per split
    (as sklearn's ``train_test_split`` and FedProx's ``n - int(0.9 n)``), reduced if needed so that it keeps
    at least one train sample. Each held-out count is spread over the client's classes in proportion to their
    counts (largest remainder, ties at random), so test and val follow the client's label distribution.
    Returns, per key, one sorted ``int64`` index array (into ``labels``) per client.
    """
    labels = as_labels(labels)
    shares = _check_fractions(fractions)
    out: dict[str, Parts] = {key: [] for key in ("train", *HOLDOUTS)}
    for i, part in enumerate(parts):
        part = np.asarray(part, dtype=np.int64)
        if len(part) and (part.min() < 0 or part.max() >= len(labels)):
            raise ConfigError(
                f"parts[{i}]: indices must be in [0, {len(labels)}) (got {part.min()}..{part.max()})"
            )
        for key, idx in _split_one(labels, part, shares, rng).items():
            out[key].append(idx)
    return out


def _check_fractions(fractions: dict[str, float]) -> list[float]:
    if not isinstance(fractions, dict):
        raise ConfigError(f"fractions: must be a mapping like {{'test': 0.25}} (got {shown(fractions)})")
    unknown = sorted((k for k in fractions if k not in HOLDOUTS), key=repr)
    if unknown:
        raise ConfigError(f"fractions: unknown split {shown(unknown[0])}; allowed: {', '.join(HOLDOUTS)}")
    shares = []
    for key in HOLDOUTS:
        try:
            shares.append(float(fractions.get(key, 0.0)))
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"fractions.{key}: must be a number (got {shown(fractions[key])})") from None
    for key, f in zip(HOLDOUTS, shares):
        if not 0.0 <= f < 1.0:
            raise ConfigError(f"fractions.{key}: must be in [0, 1) (got {f})")
    if sum(shares) >= 1.0:
        raise ConfigError(
            f"fractions: test + val must be < 1 so clients keep train data (got {sum(shares):g})"
        )
    return shares


def _holdout_sizes(n: int, shares: list[float]) -> list[int]:
    # The epsilon keeps products like 0.1 * 30 = 3.0000000000000004 from rounding up to 4.
    sizes = [math.ceil(f * n - 1e-9) for f in shares]
    while n and n - sum(sizes) < 1:
        sizes[int(np.argmax(sizes))] -= 1
    return sizes


def _split_one(labels: np.ndarray, part: np.ndarray, shares: list[float], rng) -> dict[str, np.ndarray]:
    shuffled = rng.permutation(part)
    _, cls = np.unique(labels[shuffled], return_inverse=True)
    order = np.argsort(cls, kind="stable")
    grouped, cls = shuffled[order], cls[order]
    class_sizes = np.bincount(cls)
    pos = np.arange(len(grouped)) - np.concatenate([[0], np.cumsum(class_sizes)[:-1]])[cls]

    # Each class's block is cut in order: test first, then val, then train.
    key_of = np.zeros(len(grouped), dtype=np.int64)
    start = np.zeros(len(class_sizes), dtype=np.int64)
    for k, h in enumerate(_holdout_sizes(len(part), shares), start=1):
        take = largest_remainder(class_sizes - start, h, rng)
        key_of[(pos >= start[cls]) & (pos < (start + take)[cls])] = k
        start += take
    return {key: np.sort(grouped[key_of == k]) for k, key in enumerate(("train", *HOLDOUTS))}
