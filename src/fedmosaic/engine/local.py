"""Local training of a cohort: every client's steps run in lockstep through one mapped step function.

Ragged cohorts: a client's step count is E * ceil(n_k / B), so one large client sets the number of lockstep steps.
Clients that have finished are *packed out*: the mapped step only sees the active clients (re-packed whenever the
active set shrinks), so a finished client neither moves nor costs compute. Partial last batches are padded and
masked inside the loss. The client axis is cut into chunks of ``chunk_size`` to bound memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch.func import functional_call, grad

from ..algorithms.base import Algorithm
from ..algorithms.terms import LocalContext
from . import optim
from .mapping import for_each_client
from . import augment
from .augment import AugmentConfig
from .seeding import batch_plan
from .tree import leaves, put, take, tmap


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
    """Runs the local rounds of a cohort for one architecture.

    Per step: the per-client gradient function (objective = the algorithm's terms) is mapped over the active
    clients — ``vmap`` on the fast path, a Python loop on the sequential one — and the optimiser then updates the
    stacked parameters of all of them in one in-place operation. With ``compile``, the mapped gradient function is
    compiled with ``torch.compile``, and runs of ``fuse_steps`` steps during which no client finishes are compiled
    as one call (gradients and updates), which removes most of the per-step Python overhead that dominates long
    runs of tiny steps. The number of active clients is then padded to a power of two (padding rows are masked out
    and discarded) so that a run compiles a handful of shapes rather than one per cohort size.
    """

    def __init__(self, algo: Algorithm, module: torch.nn.Module, opt: optim.OptimizerConfig, task_loss: str,
                 transform, vectorize: bool = True, chunk_size: int = 128, compile: bool = False,
                 fuse_steps: int = 1, augment: AugmentConfig | None = None, pad_fill: torch.Tensor | float = 0.0):
        self.algo, self.module, self.opt, self.task_loss = algo, module, opt, task_loss
        self.transform = transform
        self.augment = augment if augment is not None and augment.active else None
        self.pad_fill = pad_fill
        self.chunk_size = chunk_size
        self.compile = compile and vectorize
        self.fuse = fuse_steps if self.compile else 1
        each = lambda fn, dims, fresh=False: for_each_client(fn, dims, vectorize, fresh)  # noqa: E731
        self._init = each(self._local_init, (None, 0, 0), fresh=True)
        dims = (0, 0, None, 0, 0, 0, 0)
        self._map_grads = each(self._client_grads, dims)
        self._map_post_grads = each(partial(self._client_grads, objective=algo.post_grad_loss), dims)
        self._grads = self._map_grads
        if self.compile:
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self._fused = torch.compile(self._k_steps, dynamic=False)
            self._grads = torch.compile(self._map_grads, dynamic=False)
        self._finish = each(algo.finish, (0, 0, None, 0), fresh=True)

    def apply(self, params, x, buffers=None):
        """(features, logits); ``buffers`` (BatchNorm running statistics) are the client's, updated in place."""
        return functional_call(self.module, {**params, **(buffers or {})}, (x,), {"with_features": True})

    def _local_init(self, payload, state, cid):
        # ``cid`` is unused here; it gives vmap a batched input when the algorithm keeps no client state
        return self.algo.local_init(payload, state)

    def _client_grads(self, params, state, payload, x, y, mask, buffers, objective=None):
        objective = objective or self.algo.loss

        def f(p, b):  # buffers are an argument, not captured: torch.func allows in-place updates of inputs only
            ctx = LocalContext(partial(self.apply, buffers=b), p, state, payload, x, y, mask, self.task_loss)
            loss = objective(ctx)
            return loss, (loss.detach(), tmap(torch.detach, self.algo.accumulate(ctx)))

        grads, (loss, acc) = grad(f, has_aux=True)(params, buffers)
        return grads, loss, acc

    def train(self, data: ClientTensors, clients: np.ndarray, payload: dict, states, buffers, *, epochs: int,
              batch: int, lr: float, seed: int, round_idx: int):
        """Train ``clients`` (their persistent ``states`` and model ``buffers`` stacked in the same order; the
        buffers — BatchNorm running statistics — are updated in place).

        Returns (uploads, new_states, mean_loss[n], steps[n]) stacked in the order of ``clients``.
        """
        outs = []
        for lo in range(0, len(clients), self.chunk_size):
            sl = slice(lo, lo + self.chunk_size)
            outs.append(self._train_chunk(data, clients[sl], payload, tmap(lambda t: t[sl], states),
                                          tmap(lambda t: t[sl], buffers), epochs, batch, lr, seed, round_idx))
        uploads, new_states, losses, steps = zip(*outs)
        return cat_trees(list(uploads)), cat_trees(list(new_states)), torch.cat(losses), np.concatenate(steps)

    def _train_chunk(self, data, clients, payload, states, buffers, epochs, batch, lr, seed, round_idx):
        n, dev = len(clients), data.x.device
        positions, valid, steps = batch_plan(data.sizes, clients, epochs, batch, seed, round_idx)
        params = self._init(payload, states, torch.arange(n, device=dev))
        start = data.ptr[clients][:, None, None]
        # per step and client: the rows of its batch (padding points at a real row and is masked out), and the
        # augmentation draws. Step-major, so that a step's slice is contiguous (torch.compile guards on strides).
        rows = torch.as_tensor(np.where(valid, start + positions, start).transpose(1, 0, 2).copy(), device=dev)
        masks = torch.as_tensor(valid.transpose(1, 0, 2).copy(), dtype=torch.float32, device=dev)
        plan = [rows, masks]
        if self.augment is not None:
            draws = augment.draw(self.augment, clients, steps, batch, data.x.shape[1:], seed, round_idx)
            plan.append(draws.to(dev))
        post = self._post_plan(rows, masks, batch)
        loss_sum = torch.zeros(n, device=dev)
        acc_sum = None
        # ``packed`` holds the active clients' rows of everything indexed by client (first ``real`` rows; when
        # compiled, padded to a power of two with masked copies of the first so few shapes get compiled).
        # While every client is active and no padding is needed, it is the full trees themselves.
        active = np.arange(n)
        ia, real = torch.as_tensor(active, device=dev), n
        packed = (params, optim.init_state(self.opt, leaves(params)), states, buffers)
        finish_at = set(steps.tolist())
        S = int(steps.max()) if n else 0
        block0 = fused_until = 0  # steps block0..fused_until-1 run in fused blocks of ``self.fuse``
        s0 = 0  # plan tensors start at step s0
        for s in range(S):
            if s in finish_at or (s == 0 and self.compile and n & (n - 1)):
                now = np.flatnonzero(steps > s)
                if packed[0] is not params:  # write the finished clients' rows back
                    put((params, buffers), ia, tmap(lambda t: t[:real], (packed[0], packed[3])))
                keep = np.searchsorted(active, now)
                if self.compile:
                    keep = np.concatenate([keep, np.full((1 << (len(keep) - 1).bit_length()) - len(keep), keep[0])])
                keep = torch.as_tensor(keep, device=dev)
                packed = tuple(take(t, keep) for t in packed)
                # only the steps still to come: repacking then costs O(what remains), not O(the whole plan)
                plan = [t[s - s0 :].index_select(1, keep) for t in plan]
                plan[1][:, len(now) :] = 0  # padding rows never count
                active, ia, real, s0 = now, torch.as_tensor(now, device=dev), len(now), s
            if self.fuse > 1 and s >= fused_until:
                nxt = min([f for f in finish_at if f > s], default=S)
                block0, fused_until = s, s + (nxt - s) // self.fuse * self.fuse
            if s < fused_until:  # K steps in one compiled call: the active set cannot change inside them
                if (s - block0) % self.fuse:
                    continue  # already taken by the fused call that started at an earlier step
                x, y, m = self._batch(data, plan, slice(s - s0, s - s0 + self.fuse))
                loss, acc = self._fused(*packed[:3], payload, x, y, m, packed[3], torch.tensor(lr, device=dev),
                                       torch.tensor(s, device=dev))
            else:
                x, y, m = self._batch(data, plan, s - s0)
                grads, loss, acc = self._grads(packed[0], packed[2], payload, x, y, m, packed[3])
                optim.update_(self.opt, leaves(packed[0]), leaves(grads), packed[1], lr, s)
            loss_sum.index_add_(0, ia, loss[:real])
            if acc:
                if acc_sum is None:
                    acc_sum = tmap(lambda t: torch.zeros((n, *t.shape[1:]), dtype=t.dtype, device=dev), acc)
                tmap(lambda a, b: a.index_add_(0, ia, b[:real]), acc_sum, acc)
        if packed[0] is not params:
            put((params, buffers), ia, tmap(lambda t: t[:real], (packed[0], packed[3])))
        stats = {
            **self._post_grads(data, post, params, states, payload, buffers),
            "n": torch.as_tensor(data.sizes[clients], dtype=torch.float32, device=dev),
            "steps": torch.as_tensor(steps, dtype=torch.float32, device=dev),
            "lr": torch.full((n,), float(lr), device=dev),
            "acc": acc_sum if acc_sum is not None else {},
        }
        uploads, new_states = self._finish(params, states, payload, stats)
        mean_loss = loss_sum / torch.as_tensor(np.maximum(steps, 1), dtype=torch.float32, device=dev)
        return uploads, new_states, mean_loss, steps

    def _batch(self, data, plan, at):
        """Inputs, labels and mask of the step(s) ``at`` of the packed plan, transformed and augmented."""
        r = plan[0][at]
        x = self.transform(data.x[r])
        if self.augment is not None:
            x = augment.apply(self.augment, x, plan[2][at], self.pad_fill)
        return x, data.y[r], plan[1][at]

    def _post_plan(self, rows, masks, batch):
        """The first batches of the plan, kept for the algorithm's post-training gradients (e.g. FedCurv)."""
        m = -(-self.algo.post_grad_samples // batch)
        return (rows[:m].clone(), masks[:m].clone()) if m else None

    def _post_grads(self, data, post, params, states, payload, buffers) -> dict:
        """Mean over those batches of the squared minibatch gradient at the final local parameters."""
        if post is None or not len(post[0]):
            return {}
        total, count = None, torch.zeros(len(post[1][0]), device=data.x.device)
        for r, m in zip(*post):
            # on copies of the buffers: these extra forward passes must not move the running statistics
            grads, _, _ = self._map_post_grads(params, states, payload, self.transform(data.x[r]), data.y[r], m,
                                               tmap(torch.clone, buffers))
            has = (m.sum(1) > 0).to(m.dtype)
            sq = tmap(lambda g: g * g * has.view(-1, *([1] * (g.dim() - 1))), grads)
            total = sq if total is None else tmap(torch.add, total, sq)
            count += has
        return {"grad_sq": tmap(lambda t: t / count.clamp(min=1).view(-1, *([1] * (t.dim() - 1))), total)}

    def _k_steps(self, params, opt_state, state, payload, xs, ys, ms, buffers, lr, step):
        """``len(xs)`` consecutive steps of the packed clients (compiled as one graph; updates in place)."""
        loss_sum, acc_sum = 0, None
        flat = leaves(params)
        for k in range(len(xs)):
            grads, loss, acc = self._map_grads(params, state, payload, xs[k], ys[k], ms[k], buffers)
            optim.update_(self.opt, flat, leaves(grads), opt_state, lr, step + k)
            loss_sum = loss_sum + loss
            acc_sum = acc if acc_sum is None else tmap(torch.add, acc_sum, acc)
        return loss_sum, acc_sum
