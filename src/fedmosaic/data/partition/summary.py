"""Numbers that describe a partition, and the client x class count matrix behind the bubble plot."""

from __future__ import annotations

import numpy as np

from ...errors import ConfigError
from .base import Parts, as_labels


def class_counts(labels: np.ndarray, parts: Parts, num_classes: int) -> np.ndarray:
    """(clients x classes) matrix of sample counts."""
    labels = as_labels(labels)
    if len(labels) and labels.max() >= num_classes:
        raise ConfigError(f"num_classes: labels go up to {labels.max()}, so it must be > {labels.max()}")
    owner = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
    flat = labels[np.concatenate(parts).astype(np.int64)] if parts else np.zeros(0, dtype=np.int64)
    return np.bincount(owner * num_classes + flat, minlength=len(parts) * num_classes).reshape(len(parts), -1)


def summary(labels: np.ndarray, parts: Parts, num_classes: int) -> dict:
    """Sizes, classes per client and label entropy of a partition.

    ``samples_std`` is the population std (ddof=0). ``entropy_mean_nats`` is the mean over non-empty clients
    of the Shannon entropy of the client's label distribution, in nats (log(num_classes) for a uniform client,
    0 for a single-class one). ``counts`` is the (clients x classes) count matrix, for plotting.
    """
    counts = class_counts(labels, parts, num_classes)
    sizes = counts.sum(1)
    n_cls = (counts > 0).sum(1)
    nonempty = counts[sizes > 0]
    p = nonempty / nonempty.sum(1, keepdims=True)
    entropy = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(1)
    return {
        "clients": len(parts),
        "samples_total": int(sizes.sum()),
        "samples_min": int(sizes.min()),
        "samples_median": float(np.median(sizes)),
        "samples_max": int(sizes.max()),
        "samples_mean": float(sizes.mean()),
        "samples_std": float(sizes.std()),
        "classes_min": int(n_cls.min()),
        "classes_median": float(np.median(n_cls)),
        "classes_max": int(n_cls.max()),
        "entropy_mean_nats": float(entropy.mean()) if len(entropy) else 0.0,
        "counts": counts,
    }
