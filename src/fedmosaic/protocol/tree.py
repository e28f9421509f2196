"""Helpers for parameter trees: nested dicts of tensors, optionally with a leading client axis."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

Tree = dict


def tmap(fn: Callable, *trees):
    return pytree.tree_map(fn, *trees)


def leaves(tree) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def to(tree, device):
    """``tree`` with its tensors on ``device`` (other leaves as they are)."""
    return tmap(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, tree)


def clone(tree):
    return tmap(lambda t: t.clone(), tree)


def stack(trees: list):
    return tmap(lambda *ts: torch.stack(ts), *trees)


def repeat(tree, n: int):
    """Every leaf repeated ``n`` times along a new leading (client) axis, each copy its own memory."""
    return tmap(lambda t: t.unsqueeze(0).repeat(n, *([1] * t.dim())), tree)


def take(tree, idx: torch.Tensor):
    """Rows ``idx`` of every leaf (a copy; ``idx`` may be on another device, e.g. a checkpoint's rows picked
    on the host from the tensors of a GPU run)."""
    return tmap(lambda t: t.index_select(0, idx.to(t.device)), tree)


def put(tree, idx: torch.Tensor, values) -> None:
    """Write rows ``idx`` of every leaf in place."""
    pytree.tree_map(lambda t, v: t.index_copy_(0, idx, v), tree, values)



def nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in leaves(tree))


def split_keys(tree: dict, keys) -> tuple[dict, dict]:
    """(the entries of ``tree`` whose names are not in ``keys``, those that are): a model cut into its body and
    head (``Setting.head_keys``), or its BatchNorm layers and the rest (``Setting.norm_keys``)."""
    keys = set(keys)
    return {k: v for k, v in tree.items() if k not in keys}, {k: v for k, v in tree.items() if k in keys}


def weighted_mean(stacked, weights: torch.Tensor):
    """Σ_i w_i x_i / Σ_i w_i along the client axis."""
    w = weights / weights.sum()
    return tmap(lambda t: torch.tensordot(w.to(t.dtype), t, dims=1), stacked)


def all_finite(tree) -> bool:
    """No NaN or infinity in any floating-point tensor of ``tree``: read on the host once per device."""
    return all(bool(ok) for ok in finite(tree))


def finite(tree) -> list[torch.Tensor]:
    """Per device of ``tree``'s floating-point tensors, a boolean on that device: none holds a NaN or infinity.
    One pass per tensor, no temporary (a NaN makes both extremes NaN, so both tests fail; ``isfinite(t).all()``
    costs 20x more, as much as a CNN's optimiser step for every round's uploads), and nothing read on the host."""
    flags: dict = {}
    for t in leaves(tree):
        if t.is_floating_point() and t.numel():
            lo, hi = torch.aminmax(t)
            flags.setdefault(t.device, []).append((lo > -torch.inf) & (hi < torch.inf))
    return [torch.stack(f).all() for f in flags.values()]


def layout(tree, at: str = ""):
    """(path, shape, dtype) of every tensor of a nested state (and the type of every other leaf): two states with the
    same layout are interchangeable."""
    if isinstance(tree, torch.Tensor):
        yield at, tuple(tree.shape), tree.dtype
    elif isinstance(tree, dict):
        for k in sorted(tree, key=str):
            yield from layout(tree[k], f"{at}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from layout(v, f"{at}/{i}")
    else:
        yield at, type(tree).__name__, None


def cumsum(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t.cumsum(dim)``, also where a CUDA run asks for deterministic algorithms (``engine.deterministic``), which
    CUDA's floating-point cumsum is not: there it runs on the host (the same sums in the same order as on a CPU)."""
    if t.is_cuda and t.is_floating_point() and torch.are_deterministic_algorithms_enabled():
        return t.cpu().cumsum(dim).to(t.device)
    return t.cumsum(dim)
