"""Local training of a cohort: every client's steps run in lockstep through one mapped step function.

Ragged cohorts: a client's step count is E * ceil(n_k / B), so one large client sets the number of lockstep steps.
Clients that have finished are *packed out*: the mapped step only sees the active clients (re-packed whenever the
active set shrinks), so a finished client neither moves nor costs compute. Partial last batches are padded and
masked inside the loss. The client axis is cut into chunks of ``chunk_size`` to bound memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.func import functional_call, grad

from ..algorithms.base import Algorithm
from ..algorithms.terms import LocalContext
from . import optim
from .mapping import for_each_client
from .seeding import batch_plan
from .tree import put, take, tmap


@dataclass
class ClientTensors:
    """One split of the federated data on the training device: samples of client k are rows ptr[k]:ptr[k+1]."""

    x: torch.Tensor
    y: torch.Tensor
    ptr: np.ndarray

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.ptr)


def cat_trees(trees: list):
    return tmap(lambda *ts: torch.cat(ts), *trees)


class LocalTrainer:
    def __init__(self, algo: Algorithm, module: torch.nn.Module, opt: optim.OptimizerConfig, task_loss: str,
                 transform, vectorize: bool = True, chunk_size: int = 128):
        self.algo, self.module, self.opt, self.task_loss = algo, module, opt, task_loss
        self.transform = transform
        self.chunk_size = chunk_size
        each = lambda fn, dims, fresh=False: for_each_client(fn, dims, vectorize, fresh)  # noqa: E731
        self._init = each(self._local_init, (None, 0, 0), fresh=True)
        self._step = each(self._one_step, (0, 0, 0, None, 0, 0, 0, None))
        self._finish = each(algo.finish, (0, 0, None, 0), fresh=True)

    def apply(self, params, x):
        return functional_call(self.module, params, (x,), {"with_features": True})

    def _local_init(self, payload, state, cid):
        # ``cid`` is unused here; it gives vmap a batched input when the algorithm keeps no client state
        params = self.algo.local_init(payload, state)
        return params, optim.init_state(self.opt, params)

    def _one_step(self, params, opt_state, state, payload, x, y, mask, lr):
        def objective(p):
            ctx = LocalContext(self.apply, p, state, payload, x, y, mask, self.task_loss)
            loss = self.algo.loss(ctx)
            return loss, (loss.detach(), tmap(torch.detach, self.algo.accumulate(ctx)))

        grads, (loss, acc) = grad(objective, has_aux=True)(params)
        params, opt_state = optim.update(self.opt, params, grads, opt_state, lr)
        return params, opt_state, loss, acc

    def train(self, data: ClientTensors, clients: np.ndarray, payload: dict, states, *, epochs: int, batch: int,
              lr: float, seed: int, round_idx: int):
        """Train ``clients`` (their persistent ``states`` stacked in the same order).

        Returns (uploads, new_states, mean_loss[n], steps[n]) stacked in the order of ``clients``.
        """
        outs = []
        for lo in range(0, len(clients), self.chunk_size):
            sl = slice(lo, lo + self.chunk_size)
            outs.append(self._train_chunk(data, clients[sl], payload, tmap(lambda t: t[sl], states),
                                          epochs, batch, lr, seed, round_idx))
        uploads, new_states, losses, steps = zip(*outs)
        return cat_trees(list(uploads)), cat_trees(list(new_states)), torch.cat(losses), np.concatenate(steps)

    def _train_chunk(self, data, clients, payload, states, epochs, batch, lr, seed, round_idx):
        n = len(clients)
        positions, valid, steps = batch_plan(data.sizes, clients, epochs, batch, seed, round_idx)
        params, opt_state = self._init(payload, states, torch.arange(n))
        loss_sum = torch.zeros(n)
        acc_sum = None
        start = data.ptr[clients]
        active = np.arange(n)
        packed = (params, opt_state, states)  # the active clients' rows; the full trees while all are active

        def unpack():
            if len(active) < n:
                idx = torch.as_tensor(active)
                put(params, idx, packed[0])
                put(opt_state, idx, packed[1])
            else:
                tmap(lambda a, b: a.copy_(b), (params, opt_state), packed[:2])

        for s in range(int(steps.max()) if n else 0):
            now = np.flatnonzero(steps > s)
            if len(now) < len(active):  # some clients finished: write them back, keep only the rest
                unpack()
                keep = torch.as_tensor(np.searchsorted(active, now))
                packed = tuple(take(t, keep) for t in packed)
                active = now
            ok = valid[active, s]
            rows = torch.as_tensor(np.where(ok, start[active, None] + positions[active, s], start[active, None]))
            x = self.transform(data.x[rows])
            p, o, loss, acc = self._step(packed[0], packed[1], packed[2], payload, x, data.y[rows],
                                         torch.as_tensor(ok, dtype=x.dtype), lr)
            packed = (p, o, packed[2])
            ia = torch.as_tensor(active)
            loss_sum.index_add_(0, ia, loss)
            if acc:
                if acc_sum is None:
                    acc_sum = tmap(lambda t: torch.zeros((n, *t.shape[1:]), dtype=t.dtype), acc)
                tmap(lambda a, b: a.index_add_(0, ia, b), acc_sum, acc)
        if n and steps.max() > 0:
            unpack()
        stats = {
            "n": torch.as_tensor(data.sizes[clients], dtype=torch.float32),
            "steps": torch.as_tensor(steps, dtype=torch.float32),
            "lr": torch.full((n,), float(lr)),
            "acc": acc_sum if acc_sum is not None else {},
        }
        uploads, new_states = self._finish(params, states, payload, stats)
        mean_loss = loss_sum / torch.as_tensor(np.maximum(steps, 1), dtype=torch.float32)
        return uploads, new_states, mean_loss, steps
