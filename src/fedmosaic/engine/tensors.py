"""A split of the federated data on the training device, client by client, and stacks of per-client trees."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..protocol.tree import tmap


@dataclass
class ClientTensors:
    """One split of the federated data on the training device: samples of client k are rows ptr[k]:ptr[k+1].

    ``subset`` (client -> offsets inside its rows, sorted): the samples a client may train on this round when not
    all of them (the current task of a class-incremental stream); a client it does not list has none."""

    x: torch.Tensor
    y: torch.Tensor
    ptr: np.ndarray
    subset: dict | None = None

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.ptr)

    def available(self, clients: np.ndarray) -> list[np.ndarray] | None:
        """Per client the offsets of ``subset`` (None: every sample of every client)."""
        if self.subset is None:
            return None
        return [self.subset.get(int(k), np.zeros(0, dtype=np.int64)) for k in clients]

    def counts(self, clients: np.ndarray) -> np.ndarray:
        """The samples each client may train on."""
        base = self.available(clients)
        return self.sizes[clients] if base is None else np.array([len(b) for b in base], dtype=np.int64)

    def hosting(self, clients: np.ndarray) -> ClientTensors:
        """The rows of ``clients`` only (sorted ids), every other client's range left empty: client ids keep their
        meaning on a runtime that hosts some of the clients."""
        clients = np.sort(clients)
        rows = np.concatenate([np.arange(self.ptr[k], self.ptr[k + 1]) for k in clients] or [np.zeros(0, int)])
        sizes = np.zeros(len(self.ptr) - 1, dtype=np.int64)
        sizes[clients] = self.sizes[clients]
        idx = torch.as_tensor(rows, device=self.x.device)
        return ClientTensors(self.x[idx], self.y[idx], np.concatenate([[0], np.cumsum(sizes)]),
                             None if self.subset is None else {k: v for k, v in self.subset.items() if k in clients})


def cat_trees(trees: list):
    """The trees concatenated along the client axis (one tree: itself, not a copy — of a CNN cohort's uploads
    that copy costs as much as several training steps' optimiser updates)."""
    if len(trees) == 1:
        return trees[0]
    return tmap(lambda *ts: torch.cat(ts), *trees)


def gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]`` for an index tensor of any shape (index_select: a fraction of advanced indexing's overhead)."""
    return t.index_select(0, idx.reshape(-1)).view(*idx.shape, *t.shape[1:])


def to_device(a, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host array (numpy, list) as a tensor on ``device``. To a GPU it goes through pinned memory without
    waiting: a plain copy from pageable memory first waits for every kernel queued before it — a host sync, on
    the hot path each time a client of a ragged cohort finishes."""
    t = torch.as_tensor(a, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
