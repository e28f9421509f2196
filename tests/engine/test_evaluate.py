"""Evaluation of many personal models on their own ragged splits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedmosaic.engine.evaluate import personal_correct


@pytest.mark.parametrize("vectorize", [True, False])
def test_personal_correct_counts_each_clients_own_model_on_its_own_split(vectorize):
    """Power-law sizes (one large split, many small, one empty), chunked by a small budget: every client's count
    equals its own linear model's hits on exactly its own samples."""
    g = torch.Generator().manual_seed(0)
    sizes = np.array([50, 3, 0, 7, 1, 12, 2, 30])
    ptr = np.concatenate([[0], np.cumsum(sizes)])
    x = torch.randn(int(ptr[-1]), 4, generator=g)
    y = torch.randint(0, 3, (int(ptr[-1]),), generator=g)
    W = torch.randn(len(sizes), 3, 4, generator=g)
    apply = lambda p, xb: (xb, xb @ p["w"].T)  # noqa: E731
    clients = np.array([7, 0, 2, 5, 1, 3, 6, 4])
    got = personal_correct(apply, {"w": W[clients]}, x, y, ptr, clients, lambda t: t, lambda z, lg: lg, vectorize,
                           budget=60)
    want = [int((x[ptr[k] : ptr[k + 1]] @ W[k].T).argmax(1).eq(y[ptr[k] : ptr[k + 1]]).sum()) for k in clients]
    assert got.tolist() == want
