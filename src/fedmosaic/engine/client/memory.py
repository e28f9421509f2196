"""Exemplar memory of class-incremental FL: which of a client's samples it keeps when a task ends.

A client's memory maps each class it met to offsets into its own train rows, best first (:func:`rank`), so that a
smaller budget later keeps a prefix (iCaRL's reduction): a fixed count per class (ProtoFCL's strategy A) or a fixed
total shared equally by the classes met so far (strategy B). The engine refreshes it at the last round of every
task (``Federation._end_task``) and trains every client on its current task plus its memory.
"""

from __future__ import annotations

import numpy as np
import torch

Memory = dict[int, np.ndarray]  # class -> offsets into the client's train rows, best first


def rank(features: torch.Tensor, how: str, m: int, gen: np.random.Generator) -> np.ndarray:
    """The first ``m`` of one class's samples in the order they are kept, as positions into ``features`` [n, d].

    ``nearest``: by Euclidean distance to the class prototype (the features' mean; ProtoFCL eq. 9). ``herding``:
    iCaRL's greedy choice on L2-normalised features, each next sample the one that brings the mean of those chosen
    closest to the class mean. ``random``: a seeded draw."""
    n = len(features)
    m = min(m, n)
    if how == "random":
        return gen.permutation(n)[:m]
    f = features.double()
    if how == "nearest":
        d = (f - f.mean(0)).norm(dim=1)
        return np.argsort(d.cpu().numpy(), kind="stable")[:m]
    if how != "herding":
        raise ValueError(f"unknown memory selection {how!r}")
    f = f / f.norm(dim=1, keepdim=True).clamp(min=1e-12)
    mu, total, chosen = f.mean(0), torch.zeros_like(f[0]), []
    free = torch.ones(n, dtype=torch.bool, device=f.device)
    for i in range(m):
        gap = (mu - (total + f) / (i + 1)).norm(dim=1).masked_fill(~free, float("inf"))
        k = int(gap.argmin())
        chosen.append(k)
        free[k] = False
        total = total + f[k]
    return np.asarray(chosen, dtype=np.int64)


def per_class_budget(per_class: int | None, total: int | None, n_classes: int) -> int:
    """Samples kept per class: the fixed count, or the total shared equally (rounded down) by ``n_classes``."""
    if per_class is not None:
        return per_class
    return total // max(n_classes, 1)


def refresh(memory: Memory, new: dict[int, torch.Tensor], offsets: dict[int, np.ndarray], how: str,
            per_class: int | None, total: int | None, gen: np.random.Generator) -> Memory:
    """The memory once a task ends: every class in ``new`` (class -> features of the client's samples of it, at the
    offsets ``offsets[class]``) ranked and cut to the budget; the classes already kept cut to it too."""
    classes = sorted(set(memory) | set(new))
    m = per_class_budget(per_class, total, len(classes))
    out = {}
    for c in classes:
        if c in new:
            out[c] = offsets[c][rank(new[c], how, m, gen)]
        else:
            out[c] = memory[c][:m]
    return out


def offsets_of(memory: Memory) -> np.ndarray:
    """Every offset the memory holds, sorted."""
    return np.sort(np.concatenate([np.zeros(0, dtype=np.int64), *memory.values()]))


def pack(memory: Memory) -> torch.Tensor:
    """[2, n]: classes and offsets, classes ascending and each class best first (for checkpoints)."""
    pairs = [(c, o) for c in sorted(memory) for o in memory[c]]
    return torch.as_tensor(np.asarray(pairs, dtype=np.int64).reshape(-1, 2).T.copy())


def unpack(t: torch.Tensor) -> Memory:
    c, o = t.cpu().numpy()
    return {int(k): o[c == k] for k in np.unique(c)}
