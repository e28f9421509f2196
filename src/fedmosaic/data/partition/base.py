"""What every partition scheme shares: the config base class, argument checks and the owner-array helper."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from ...errors import ConfigError

Parts = list[np.ndarray]


class PartitionScheme(BaseModel):
    """A seeded rule that splits a labelled dataset into per-client index arrays.

    ``split`` returns one sorted ``int64`` array per client, indexing into ``labels``; the arrays are disjoint
    and cover every sample unless the scheme's docstring says which samples it drops. All randomness comes
    from ``rng``, so the same config and seed give identical arrays.

    Most schemes take the client count from the caller. Schemes whose count is part of the setting (the
    FedProx generators, natural groups) accept ``n_clients=None`` meaning "the scheme's own count" and raise
    ConfigError for any other number; ``num_clients`` answers the count before splitting.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    def num_clients(self, n_requested: int | None, groups: np.ndarray | None = None) -> int:
        """The number of clients ``split`` will return for this request."""
        if n_requested is None:
            raise ConfigError(f"n_clients: required for partition scheme '{self.scheme}'")
        if isinstance(n_requested, bool) or not isinstance(n_requested, (int, np.integer)) or n_requested < 1:
            raise ConfigError(f"n_clients: must be a positive integer (got {n_requested!r})")
        return int(n_requested)

    def split(
        self,
        labels: np.ndarray,
        n_clients: int | None,
        rng: np.random.Generator,
        groups: np.ndarray | None = None,
    ) -> Parts:
        labels = as_labels(labels)
        n = self.num_clients(n_clients, groups)
        return self._split(labels, n, rng, groups)

    def split_paired(
        self,
        train_labels: np.ndarray,
        test_labels: np.ndarray,
        n_clients: int | None,
        rng: np.random.Generator,
        groups: np.ndarray | None = None,
    ) -> tuple[Parts, Parts | None]:
        """Split the train set and, where the scheme defines it, the test set the same way.

        The second item is None for schemes with no paired test split; callers then use the global test set or
        ``client_split``.
        """
        return self.split(train_labels, n_clients, rng, groups), None

    def _split(self, labels: np.ndarray, n_clients: int, rng: np.random.Generator, groups) -> Parts:
        raise NotImplementedError


def fixed_clients(n_requested: int | None, count: int, what: str) -> int:
    """For schemes whose setting fixes the client count: accept None (meaning ``count``) or ``count``."""
    if n_requested is None or n_requested == count:
        return count
    raise ConfigError(
        f"n_clients: {what} fixes {count} clients (got {n_requested}); "
        f"leave n_clients unset or set it to {count}"
    )


def as_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ConfigError(
            f"labels: must be a 1-D integer array (got dtype {labels.dtype}, shape {labels.shape})"
        )
    if len(labels) and labels.min() < 0:
        raise ConfigError(f"labels: must be >= 0 (got {labels.min()})")
    return labels.astype(np.int64, copy=False)


def require_samples_per_client(
    n_samples: int, n_clients: int, min_each: int = 1, param: str = "n_clients"
) -> None:
    if n_samples < n_clients * min_each:
        need = f"{min_each} sample{'s' if min_each > 1 else ''}"
        raise ConfigError(
            f"{param}: {n_clients} clients with at least {need} each need {n_clients * min_each} samples, "
            f"but there are only {n_samples}"
        )


def parts_from_owner(owner: np.ndarray, n_clients: int) -> Parts:
    """Per-client sorted index arrays from ``owner[i]`` = the client of sample i (-1 = dropped)."""
    kept = np.flatnonzero(owner >= 0)
    # A stable sort keeps each client's indices ascending, so no per-client sort is needed.
    order = kept[np.argsort(owner[kept], kind="stable")]
    counts = np.bincount(owner[kept], minlength=n_clients)
    return [p.astype(np.int64) for p in np.split(order, np.cumsum(counts)[:-1])]


def owner_from_counts(labels: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Give client k ``counts[k, c]`` random samples of class c; samples left over get owner -1.

    ``counts`` is (clients x classes); a class's column may sum to less than its size, never more.
    """
    owner = np.full(len(labels), -1, dtype=np.int64)
    n_clients = counts.shape[0]
    for c, members in enumerate(class_members(labels, counts.shape[1])):
        col = counts[:, c]
        if col.any():
            owner[rng.permutation(members)[: int(col.sum())]] = np.repeat(np.arange(n_clients), col)
    return owner


def class_members(labels: np.ndarray, num_classes: int | None = None) -> list[np.ndarray]:
    """Indices of each class 0..C-1, ascending (one sort instead of a scan per class)."""
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if len(labels) else 0
    order = np.argsort(labels, kind="stable")
    sizes = np.bincount(labels, minlength=num_classes)[:num_classes]
    return np.split(order[: sizes.sum()], np.cumsum(sizes)[:-1])


def even_sizes(total: int, parts: int) -> np.ndarray:
    """Sizes of ``parts`` pieces of ``total`` differing by at most one, the larger ones first."""
    return np.full(parts, total // parts, dtype=np.int64) + (np.arange(parts) < total % parts)


def largest_remainder(weights: np.ndarray, total: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """Integer counts proportional to ``weights`` summing exactly to ``total``.

    Ties in the fractional parts are broken at random when ``rng`` is given, so no position is favoured.
    """
    weights = np.asarray(weights, dtype=np.float64)
    s = weights.sum()
    if total == 0 or s <= 0:
        return np.zeros(len(weights), dtype=np.int64)
    raw = weights / s * total
    base = np.floor(raw).astype(np.int64)
    short = total - int(base.sum())
    if short > 0:
        frac = raw - base
        tie = rng.random(len(weights)) if rng is not None else -np.arange(len(weights), dtype=np.float64)
        base[np.lexsort((-tie, -frac))[:short]] += 1
    return base


_TEMPLATES = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
}


def validation_error_message(err: ValidationError, prefix: str, allowed_fields: list[str]) -> str:
    """One line naming each offending parameter, e.g. ``partition.alpha: must be > 0 (got -1)``."""
    pieces = []
    for e in err.errors(include_url=False):
        name = ".".join([prefix, *(str(p) for p in e["loc"])])
        ctx = {k: f"{v:g}" if isinstance(v, float) else v for k, v in (e.get("ctx") or {}).items()}
        if e["type"] in _TEMPLATES:
            text = _TEMPLATES[e["type"]].format(**ctx)
        elif e["type"] == "extra_forbidden":
            text = f"unknown parameter; allowed: {', '.join(allowed_fields)}"
        elif e["type"] == "literal_error":
            text = f"must be {ctx.get('expected')}"
        else:
            text = e["msg"][0].lower() + e["msg"][1:]
        pieces.append(f"{name}: {text} (got {e['input']!r})")
    return "; ".join(pieces)
