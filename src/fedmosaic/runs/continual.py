"""Continual-learning metrics (METHODS.md §6-7), pure functions of the accuracy matrix.

``a[i][j]``: accuracy after training on task i, on task j's classes (j <= i; later tasks are not defined yet: NaN).
``seen[i]``: class-incremental accuracy after task i on every class seen so far, without task id (ProtoFCL's
Table 2 row; the samples of all seen classes pooled). Definitions: average incremental accuracy = mean of ``seen``
(ProtoFCL's "avg"); final average accuracy ACC = mean_j a[T-1][j] and backward transfer BWT = mean_{j < T-1}
(a[T-1][j] - a[j][j]) (Lopez-Paz & Ranzato, GEM); forgetting of task j < T-1 = max_{i < T-1} a[i][j] - a[T-1][j]
(Chaudhry et al.). A task whose column is empty (NaN), or that the last row did not judge, is left out of these
means; with no old task to judge BWT and forgetting are undefined (None), not 0 (no forgetting).
"""

from __future__ import annotations

import numpy as np


def continual_summary(a, seen=None) -> dict:
    a = np.asarray(a, dtype=np.float64)
    T = len(a)
    if a.shape != (T, T) or T == 0:
        raise ValueError(f"the accuracy matrix must be square and non-empty (got shape {a.shape})")
    # a column with no classes (random task orders: a stage in which the federation met no new class) is NaN
    # throughout and left out of every mean
    last, cols = a[-1], ~np.isnan(np.diag(a))
    judged = cols & ~np.isnan(last)
    out = {"acc_final": float(np.mean(last[judged])) if judged.any() else None, "bwt": None, "forgetting": [], "forgetting_mean": None}
    old = cols[:-1] & ~np.isnan(last[:-1])
    if T > 1 and old.any():
        out["bwt"] = float(np.mean((last[:-1] - np.diag(a)[:-1])[old]))
        f = [float(np.nanmax(a[j:T - 1, j]) - last[j]) if old[j] else float("nan") for j in range(T - 1)]
        out["forgetting"], out["forgetting_mean"] = f, float(np.nanmean(f))
    if seen is not None:
        seen = [float(s) for s in seen]
        out["seen"], out["avg_incremental"] = seen, float(np.mean(seen))
    return out
