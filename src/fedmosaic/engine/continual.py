"""Continual-learning metrics (METHODS.md §6-7), pure functions of the accuracy matrix.

``a[i][j]``: accuracy after training on task i, on task j's classes (j <= i; later tasks are not defined yet: NaN).
``seen[i]``: class-incremental accuracy after task i on every class seen so far, without task id (ProtoFCL's
Table 2 row; the samples of all seen classes pooled). Definitions: average incremental accuracy = mean of ``seen``
(ProtoFCL's "avg"); final average accuracy ACC = mean_j a[T-1][j] and backward transfer BWT = mean_{j < T-1}
(a[T-1][j] - a[j][j]) (Lopez-Paz & Ranzato, GEM); forgetting of task j < T-1 = max_{i < T-1} a[i][j] - a[T-1][j]
(Chaudhry et al.).
"""

from __future__ import annotations

import numpy as np


def continual_summary(a, seen=None) -> dict:
    a = np.asarray(a, dtype=np.float64)
    T = len(a)
    if a.shape != (T, T) or T == 0:
        raise ValueError(f"the accuracy matrix must be square and non-empty (got shape {a.shape})")
    last = a[-1]
    out = {"acc_final": float(last.mean()), "bwt": 0.0, "forgetting": [], "forgetting_mean": 0.0}
    if T > 1:
        out["bwt"] = float(np.mean(last[:-1] - np.diag(a)[:-1]))
        f = [float(np.nanmax(a[j:T - 1, j]) - last[j]) for j in range(T - 1)]
        out["forgetting"], out["forgetting_mean"] = f, float(np.mean(f))
    if seen is not None:
        seen = [float(s) for s in seen]
        out["seen"], out["avg_incremental"] = seen, float(np.mean(seen))
    return out
