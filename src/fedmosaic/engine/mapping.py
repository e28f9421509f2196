"""The one primitive that runs a per-client function for every client of a stack: vmap, or a plain loop.

Both receive and return stacked trees, so the engine's code is the same on the fast and the sequential path; only
*how* the function is applied differs. That makes "vectorized ≡ sequential" a test of vmap, not of two engines.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.func import vmap

from ..protocol.tree import clone, leaves, stack, tmap


def _batch_size(args, in_dims) -> int:
    for a, d in zip(args, in_dims, strict=True):
        if d == 0:
            ls = leaves(a)
            if ls:
                return ls[0].shape[0]
    raise ValueError("for_each_client needs at least one stacked argument")


def for_each_client(fn: Callable, in_dims: tuple, vectorize: bool, fresh: bool = False) -> Callable:
    """``fresh``: the outputs will be written in place later, so give them their own memory."""
    if vectorize:
        mapped = vmap(fn, in_dims=in_dims)
        if fresh:  # vmap returns outputs that do not depend on the client as broadcast views
            return lambda *args: clone(mapped(*args))
        return mapped

    def looped(*args):
        n = _batch_size(args, in_dims)
        outs = [
            fn(*(tmap(lambda t, i=i: t[i], a) if d == 0 else a for a, d in zip(args, in_dims, strict=True)))
            for i in range(n)
        ]
        return stack(outs)

    return looped
