"""Probes: passes over a client's batches at the received or the final parameters that compute without training —
the mean squared minibatch gradient (FedCurv's Fisher), the gradient of the mean loss (APFL-PD's importance) or
sums of a function of the batch (FedPAC's and ProtoFCL's per-class feature sums)."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from ...protocol.program import Probe, Step
from ...protocol.tree import tmap
from .. import stopping
from .objective import _sub


class Probes:
    """The probes of :class:`~.local.LocalTrainer` (a part of it)."""

    def _probe(self, data, plan, params, states, payload, own, buffers, probe: Probe):
        """Per client: the mean squared minibatch gradient (``grad_sq``) or the gradient of the mean loss
        (``grad``) over its first batches of ``plan``, with the model's dropout layers off (``_measuring``)."""
        with self._measuring(running_stats=probe.batchnorm == "running"):
            return self._probe_off(data, plan, params, states, payload, own, buffers, probe)

    def _probe_off(self, data, plan, params, states, payload, own, buffers, probe: Probe):
        # a straggler's probe passes over the batches of the whole plan, not only those it trained on
        plan = {**plan, **plan.get("uncut", {})}
        if probe.samples is not None:
            m = -(-probe.samples // plan["batch"])
            masks = plan["mask"][:m]
        else:  # one pass: each client's first epoch
            m = int(plan["per_epoch"].max(initial=0))
            first = torch.as_tensor(np.arange(m)[:, None] < plan["per_epoch"][None, :], device=data.x.device)
            masks = plan["mask"][:m] * first[..., None]
        if probe.kind == "sums":
            return self._probe_sums(data, plan["rows"][:m], masks, params, states, payload, own, buffers,
                                    probe.objective or self.algo.accumulate)
        fn = self._grad_fn(Step(probe.slots), probe.objective or self.algo.post_grad_loss, with_acc=False)
        total, count = None, torch.zeros(len(plan["steps"]), device=data.x.device)
        for c, x, y, mk in self._probe_batches(data, plan["rows"][:m], masks):
            # on copies of the buffers: these extra forward passes must not move the running statistics
            p, s, o, b = self._rows((params, states, own, buffers), c)
            b = tmap(torch.clone, b)
            live = mk.sum(1) > 0
            grads, _, _ = self._scaled(lambda: fn(p, s, payload, o, x, y, mk, (), b), o, b, live)
            w = live.to(mk.dtype) if probe.kind == "grad_sq" else mk.sum(1)
            part = tmap(lambda g: (g * g if probe.kind == "grad_sq" else g) * w.view(-1, *([1] * (g.dim() - 1))),
                        grads)
            total = _add_at(total, c, part, len(count))
            count[c] += w
        if total is None:
            return tmap(torch.zeros_like, _sub(params, probe.slots))
        return tmap(lambda t: t / count.clamp(min=1).view(-1, *([1] * (t.dim() - 1))), total)

    @torch.no_grad()
    def _probe_sums(self, data, rows, masks, params, states, payload, own, buffers, fn):
        """Per client: the sums of ``fn(ctx)`` (a dict of per-batch sums) over the batches ``rows`` (masked)."""
        mapped = self._each(partial(self._client_sums, fn=fn), (0, 0, None, 0, 0, 0, 0, 0, 0))
        total = None
        for c, x, y, mk in self._probe_batches(data, rows, masks):
            p, s, o, b = self._rows((params, states, own, buffers), c)
            part = mapped(p, s, payload, o, x, y, mk, (), tmap(torch.clone, b))  # (copies: must not move statistics)
            total = _add_at(total, c, part, rows.shape[1])
        if total is None:  # no client of this chunk has a batch (all empty): the zeros of one fully masked pass
            r = torch.zeros((rows.shape[1], 1), dtype=torch.long, device=data.x.device)
            part = mapped(params, states, payload, own, self.transform(data.x[r]), data.y[r],
                          torch.zeros(r.shape, device=data.x.device), (), tmap(torch.clone, buffers))
            total = tmap(torch.zeros_like, part)
        return total

    def _probe_batches(self, data, rows, masks):
        """The batches of a probe as (clients, x, y, mask), ``clients`` a slice of the cohort: vectorized, every
        step for all clients at once; looped, client after client and only the batches it has — the padding steps
        of the clients with fewer batches than the cohort's largest would cost a full pass each — in the memory
        order its training steps use (channels-last convolutions on the CPU). The sums are those of the stacked
        passes exactly: a padding step adds zeros."""
        if self.vectorize:
            for r, mk in zip(rows, masks):
                stopping.check()
                yield slice(None), self.transform(data.x[r]), data.y[r], mk
            return
        has = (masks.sum(-1) > 0).T.tolist()  # [client][step]
        for i, steps in enumerate(has):
            for j in (j for j, h in enumerate(steps) if h):
                stopping.check()
                x = self.transform(data.x[rows[j, i]])
                x = self._nhwc(x) if self.channels_last else x
                yield slice(i, i + 1), x[None], data.y[rows[j, i]][None], masks[j, i][None]

    def _client_sums(self, params, state, shared, own, x, y, mask, pair, buffers, fn):
        return tmap(torch.detach, fn(self._ctx(params, state, {**shared, "own": own}, x, y, mask, pair, buffers)))


def _add_at(total, clients: slice, part, n: int):
    """``total`` (None: zeros for ``n`` clients) with ``part`` added to the rows of ``clients``."""
    if total is None:
        total = tmap(lambda t: t.new_zeros((n, *t.shape[1:])), part)
    tmap(lambda t, p: t[clients].add_(p), total, part)
    return total
