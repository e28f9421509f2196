"""What every partition scheme shares: the config base class, argument checks and the owner-array helper."""

from __future__ import annotations

import difflib
import math
import re

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from ...errors import ConfigError

Parts = list[np.ndarray]

# Upper bounds of the scheme parameters: far above any published setting, low enough that no partitioner
# allocates absurd memory or runs for hours. Float bounds also keep numpy's samplers finite.
MAX_COUNT = 10**6  # clients, users, shards or classes per client
MAX_SAMPLES = 10**7  # a number of samples (min_size, first, min_per_class, offset)
MAX_RETRIES = 10**4  # Dirichlet passes; each costs a full pass over the classes
MAX_SIGMA = 20.0  # lognormal sigma: exp(20 z) overflows only for z > 35 (probability ~1e-270)


class PartitionScheme(BaseModel):
    """A seeded rule that splits a labelled dataset into per-client index arrays.

    ``split`` returns one sorted ``int64`` array per client, indexing into ``labels``; the arrays are disjoint
    and cover every sample unless the scheme's docstring says which samples it drops. All randomness comes
    from ``rng``, so the same config and seed give identical arrays.

    Most schemes take the client count from the caller. Schemes whose count is part of the setting (the
    FedProx generators, natural groups) accept ``n_clients=None`` meaning "the scheme's own count" and raise
    ConfigError for any other number; ``num_clients`` answers the count before splitting.
    """

    # strict: a bool is not a number and "3" is not an int (an int is still accepted for a float parameter);
    # allow_inf_nan=False: NaN and +-inf are rejected for every float parameter.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _numpy_scalars_as_python(cls, data):
        # numpy ints and floats (e.g. from np.arange sweeps) are numbers; np.bool_ stays a bool (rejected).
        if isinstance(data, dict):
            return {
                k: v.item() if isinstance(v, (np.integer, np.floating)) else v for k, v in data.items()
            }
        return data

    def num_clients(self, n_requested: int | None, groups: np.ndarray | None = None) -> int:
        """The number of clients ``split`` will return for this request."""
        if n_requested is None:
            raise ConfigError(f"n_clients: required for partition scheme '{self.scheme}'")
        if not is_count(n_requested) or n_requested < 1:
            raise ConfigError(f"n_clients: must be a positive integer (got {shown(n_requested)})")
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


def is_count(x) -> bool:
    """Whether ``x`` is an integer (Python or numpy), not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def fixed_clients(n_requested: int | None, count: int, what: str) -> int:
    """For schemes whose setting fixes the client count: accept None (meaning ``count``) or ``count``."""
    if n_requested is None or (is_count(n_requested) and n_requested == count):
        return count
    raise ConfigError(
        f"n_clients: {what} fixes {count} clients (got {shown(n_requested)}); "
        f"leave it unset or set it to {count}"
    )


def as_labels(labels: np.ndarray) -> np.ndarray:
    try:
        labels = np.asarray(labels)
    except (ValueError, TypeError):
        raise ConfigError("labels: must be a 1-D integer array (got a ragged or mixed sequence)") from None
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ConfigError(
            f"labels: must be a 1-D integer array (got dtype {labels.dtype}, shape {labels.shape})"
        )
    if len(labels) and labels.min() < 0:
        raise ConfigError(f"labels: must be >= 0 (got {labels.min()})")
    if len(labels) and labels.dtype == np.uint64 and labels.max() > np.iinfo(np.int64).max:
        raise ConfigError(f"labels: must fit in int64 (got {labels.max()})")
    return labels.astype(np.int64, copy=False)


def class_ranks(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct labels ascending, each sample's rank among them, and each class's size.

    Working on ranks instead of raw label values keeps arrays indexed by class as small as the number of
    classes present (labels like {0, 10**9} need two columns, not 10**9). Classes absent from ``labels`` take
    no randomness in any scheme, so ranks give the same partitions as the raw values.
    """
    classes, ranks, sizes = np.unique(labels, return_inverse=True, return_counts=True)
    return classes, ranks.reshape(-1).astype(np.int64), sizes.astype(np.int64)


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
    if n_clients == 0:
        return []
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


def usable_weights(weights: np.ndarray) -> np.ndarray:
    """Non-negative weights with a finite, positive sum, for draws that overflowed or underflowed.

    Weights that already have a finite positive sum are returned unchanged. Otherwise: +inf weights (a
    sampler overflow) share everything equally, as the limit of a weight that dwarfs all finite ones; finite
    weights whose sum overflows are rescaled by their maximum; all-zero weights (underflow) become equal.
    NaN and negative weights count as 0.
    """
    w = np.asarray(weights, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        s = w.sum()
    if np.isfinite(s) and s > 0 and not (w < 0).any():
        return w
    w = np.where(np.isnan(w) | (w < 0), 0.0, w)
    if np.isposinf(w).any():
        return np.isposinf(w).astype(np.float64)
    peak = w.max(initial=0.0)
    return w / peak if peak > 0 else np.ones(len(w))


def largest_remainder(weights: np.ndarray, total: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """Integer counts proportional to ``weights`` summing exactly to ``total``.

    Ties in the fractional parts are broken at random when ``rng`` is given, so no position is favoured.
    Weights that overflowed, underflowed to all zeros or contain NaN go through ``usable_weights`` first.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if total == 0 or len(weights) == 0:
        return np.zeros(len(weights), dtype=np.int64)
    weights = usable_weights(weights)
    s = weights.sum()
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
    "finite_number": "must be a finite number",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
}


def shown(value, limit: int = 60) -> str:
    """``repr(value)`` for an error message: one line, at most ``limit`` characters, never raising."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**limit:
        # repr of an int this long is unreadable, and beyond 4300 digits Python refuses to make it.
        return f"~{'-' if value < 0 else ''}1e{math.floor(math.log10(abs(value)))}"
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    text = " ".join(text.splitlines())
    return text if len(text) <= limit else text[: limit - 3] + "..."


_YAML_STRING_FLOAT = re.compile(r"([+-]?\d+)([eE][+-]?\d+)")


def _number(v: float) -> str:
    return str(int(v)) if v.is_integer() and abs(v) < 1e16 else f"{v:g}"


def _loc_part(p) -> str:
    text = str(p)
    return text if text.isprintable() and len(text) <= 60 else shown(p)


def validation_error_message(err: ValidationError, prefix: str, allowed_fields: list[str]) -> str:
    """One line naming each offending parameter, e.g. ``partition.alpha: must be > 0 (got -1)``."""
    pieces = []
    for e in err.errors(include_url=False):
        name = ".".join([prefix, *(_loc_part(p) for p in e["loc"])])
        ctx = {k: _number(v) if isinstance(v, float) else v for k, v in (e.get("ctx") or {}).items()}
        got = e.get("input")
        if e["type"] in ("int_type", "float_type") and isinstance(got, str):
            text = f"{_TEMPLATES[e['type']]}, not a string"
        elif e["type"] == "float_type" and isinstance(got, int) and not isinstance(got, bool):
            text = _TEMPLATES["finite_number"]  # an int too large for a float
        elif e["type"] in _TEMPLATES:
            text = _TEMPLATES[e["type"]].format(**ctx)
        elif e["type"] == "extra_forbidden":
            near = difflib.get_close_matches(str(e["loc"][-1]), allowed_fields, n=1, cutoff=0.6)
            text = f"unknown parameter; {f'did you mean {near[0]!r}? ' if near else ''}allowed: {', '.join(allowed_fields)}"
        elif e["type"] == "literal_error":
            text = f"must be {ctx.get('expected')}"
        else:
            text = e["msg"][0].lower() + e["msg"][1:]
        piece = f"{name}: {text} (got {shown(got)})"
        # PyYAML reads 1e-3 (no dot in the mantissa) as a string, a common way to end up here.
        m = _YAML_STRING_FLOAT.fullmatch(got.strip()) if isinstance(got, str) else None
        if m and e["type"] == "float_type":
            piece += f"; YAML reads {got.strip()} as a string: write {m[1]}.0{m[2]}"
        pieces.append(piece)
    return "; ".join(pieces)
