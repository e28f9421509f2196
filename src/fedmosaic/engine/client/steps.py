"""The step runner of a phase (:class:`PhaseSteps`, a part of ``local.LocalTrainer``): every step of the plan for
the active clients in lockstep — packing finished clients out, looping the last few, compiled fused blocks — the
optimiser updates, and ``Phase.until``'s repeats."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ...protocol.program import Phase, Step
from ...protocol.tree import leaves, put, take, tmap
from .. import stopping
from ..tensors import gather, to_device
from . import augment, optim
from .objective import _sub


class Packed(NamedTuple):
    """The active clients' rows of everything the step runner indexes by client (optimiser state per update)."""

    params: dict
    opt: list
    states: dict
    buffers: dict
    own: dict


class PhaseSteps:
    """The lockstep step runner (mixed into ``LocalTrainer``, whose attributes it reads)."""

    def _repeat(self, data, plan, params, states, payload, own, buffers, phase: Phase, lr, loss, acc, last):
        """``Phase.until``: the plan's batches run again, lockstep, by the clients not yet done (their rows taken
        out, trained, put back); their losses and stats are added to ``loss`` and ``acc`` in place. Returns the
        steps each client took in all."""
        key = ("until", phase.until)
        if key not in self._fns:
            self._fns[key] = self._each(lambda h, p, s, shared, o: phase.until(h, p, s, {**shared, "own": o}),
                                        (0, 0, 0, None, 0))
        steps, losses = plan["steps"].copy(), [last]
        left = np.ones(len(steps), dtype=bool)
        for _ in range(phase.max_repeats):
            left &= ~self._fns[key](torch.stack(losses, 1), params, states, payload, own).cpu().numpy()
            idx = np.flatnonzero(left)
            if not len(idx):
                break
            i = torch.as_tensor(idx, device=data.x.device)
            sub = {k: v.index_select(1, i) if isinstance(v, torch.Tensor) else v[idx] if isinstance(v, np.ndarray)
                   else v for k, v in plan.items()}
            p_, b_, last_ = take(params, i), take(buffers, i), torch.zeros(len(idx), device=data.x.device)
            loss_, acc_ = self._run_phase(data, sub, p_, take(states, i), payload, take(own, i), b_, phase, lr, last_)
            put((params, buffers), i, (p_, b_))
            loss.index_add_(0, i, loss_)
            tmap(lambda a, b, i=i: a.index_add_(0, i, b), acc, acc_)
            steps[idx] += sub["steps"]
            losses.append(last.index_copy(0, i, last_))
            last = losses[-1]
        return steps

    def _run_phase(self, data, plan, params, states, payload, own, buffers, phase: Phase, lr, last=None):
        """The step runner: every step of the plan for the active clients, in lockstep; ``params`` and ``buffers``
        are updated in place. Returns the per-client sum of the first update's losses and of accumulated stats;
        ``last`` (if given) receives each client's first-update loss of its last step."""
        n, dev, steps = len(plan["steps"]), data.x.device, plan["steps"]
        # compiled: every update's gradient function compiled, the cohort padded to a power of two (few shapes) and
        # never looped; ``fast``: the default phase, whose steps the fused calls also run
        padded, fast = self.compile, self.compile and phase.plain
        updates = list(dict.fromkeys(phase.updates))  # equal updates share one optimiser state
        fns = [self._grads if fast and i == 0 else self._grad_fn(u, with_acc=i == 0, compiled=self.compile)
               for i, u in enumerate(phase.updates)]
        tensors = {k: v for k, v in plan.items() if isinstance(v, torch.Tensor)}
        loss_sum = torch.zeros(n, device=dev)
        acc_sum = None
        # ``packed`` holds the active clients' rows of everything indexed by client (first ``real`` rows; when
        # compiled, padded to a power of two with masked copies of the first so few shapes get compiled).
        # While every client is active and no padding is needed, it is the full trees themselves.
        active = np.arange(n)
        ia, real = to_device(active, dev), n
        opt = [optim.init_state(self._opt(u), leaves(_sub(params, u.slots))) for u in updates]
        packed = Packed(params, opt, states, buffers, own)
        finish_at = set(steps.tolist())
        S = int(steps.max()) if n else 0
        if fast:  # the fused calls' learning rate and step counter, made on the device (no copy from the host)
            lr_t, step_t = torch.full((), float(lr), device=dev), torch.arange(S, device=dev)
        block0 = fused_until = 0  # steps block0..fused_until-1 run in fused blocks of ``self.fuse``
        s0 = 0  # plan tensors start at step s0
        for s in range(S):
            stopping.check()  # a signal's grace is over: stop at this step, the round unfinished
            if s in finish_at or (s == 0 and padded and n & (n - 1)):
                now = np.flatnonzero(steps > s)
                if packed.params is not params:  # write the finished clients' rows back
                    put((params, buffers), ia, tmap(lambda t: t[:real], (packed.params, packed.buffers)))
                keep = np.searchsorted(active, now)
                if padded:
                    keep = np.concatenate([keep, np.full((1 << (len(keep) - 1).bit_length()) - len(keep), keep[0])])
                keep = to_device(keep, dev)
                packed = Packed(*(take(t, keep) for t in packed))
                # only the steps still to come: repacking then costs O(what remains), not O(the whole plan)
                tensors = {k: t[s - s0 :].index_select(1, keep) for k, t in tensors.items()}
                for k in ("mask", "mask2"):
                    if k in tensors:
                        tensors[k][:, len(now) :] = 0  # padding rows never count
                active, ia, real, s0 = now, to_device(now, dev), len(now), s
            if not padded and real < self.loop_below:  # few clients left: the rest of the phase on the loop
                loss, acc, final = self._loop_rest(data, tensors, s, s0, packed, real, steps[active] - s,
                                                   phase.updates, updates, payload, lr,
                                                   (plan["forward"], plan["clients"][active]))
                loss_sum.index_add_(0, ia, loss)
                if last is not None:
                    last.index_copy_(0, ia, final)
                if acc:
                    if acc_sum is None:
                        acc_sum = tmap(lambda t: torch.zeros((n, *t.shape[1:]), dtype=t.dtype, device=dev), acc)
                    tmap(lambda a, b: a.index_add_(0, ia, b), acc_sum, acc)
                break
            if self.fuse > 1 and fast and s >= fused_until:
                nxt = min([f for f in finish_at if f > s], default=S)
                block0, fused_until = s, s + (nxt - s) // self.fuse * self.fuse
            p_, o_, st_, b_, own_ = packed
            if fast and s < fused_until:  # K steps in one compiled call: the active set cannot change inside them
                if (s - block0) % self.fuse:
                    continue  # already taken by the fused call that started at an earlier step
                x, y, m, *_ = self._batch(data, tensors, slice(s - s0, s - s0 + self.fuse))
                loss, acc = self._fused(p_, o_[0], st_, payload, own_, x, y, m, b_, lr_t, step_t[s].clone())
            else:
                batch = self._batch(data, tensors, s - s0)
                for i, u in enumerate(phase.updates):
                    grads, l_, a_ = self._scaled(lambda i=i: fns[i](p_, st_, payload, own_, *batch, b_), own_, b_)
                    self._update(u, leaves(_sub(p_, u.slots)), leaves(grads), o_[updates.index(u)], lr, s)
                    if i == 0:
                        loss, acc = l_, a_
            loss_sum.index_add_(0, ia, loss[:real])
            if last is not None:  # (never fused: a phase with ``until`` is not ``plain``)
                last.index_copy_(0, ia, loss[:real])
            if acc:
                if acc_sum is None:
                    acc_sum = tmap(lambda t: torch.zeros((n, *t.shape[1:]), dtype=t.dtype, device=dev), acc)
                tmap(lambda a, b: a.index_add_(0, ia, b[:real]), acc_sum, acc)
        if packed.params is not params:
            put((params, buffers), ia, tmap(lambda t: t[:real], (packed.params, packed.buffers)))
        return loss_sum, acc_sum if acc_sum is not None else {}

    def _opt(self, u: Step) -> optim.OptimizerConfig:
        return optim.PLAIN if u.plain else self.opt

    def _update(self, u: Step, params: list, grads: list, opt_state: dict, lr, s) -> None:
        """The optimiser step of update ``u`` (both eager paths: stacked leaves, or one client's rows of them)."""
        if not params:  # nothing to train (e.g. FedALA with no mixed layer)
            return
        optim.update_(self._opt(u), params, grads, opt_state, lr if u.lr is None else u.lr, s)
        if u.clamp is not None:  # projected step (values that must stay in a box)
            for t in params:
                t.clamp_(*u.clamp)

    def _batch(self, data, plan, at):
        """Inputs, labels and mask of the step(s) ``at`` and the paired batch's (or ()), transformed and
        augmented."""
        r = plan["rows"][at]
        x = self.transform(gather(data.x, r))
        if "draws" in plan:
            x = augment.apply(self.augment, x, plan["draws"][at], self.pad_fill)
        if "rows2" not in plan:
            return x, gather(data.y, r), plan["mask"][at], ()
        r2 = plan["rows2"][at]
        return (x, gather(data.y, r), plan["mask"][at],
                (self.transform(gather(data.x, r2)), gather(data.y, r2), plan["mask2"][at]))

    def _k_steps(self, params, opt_state, state, payload, own, xs, ys, ms, buffers, lr, step):
        """``len(xs)`` consecutive steps of the packed clients (compiled as one graph; updates in place)."""
        loss_sum, acc_sum = 0, None
        flat = leaves(params)
        for k in range(len(xs)):
            grads, loss, acc = self._default(params, state, payload, own, xs[k], ys[k], ms[k], (), buffers)
            optim.update_(self.opt, flat, leaves(grads), opt_state, lr, step + k)
            loss_sum = loss_sum + loss
            acc_sum = acc if acc_sum is None else tmap(torch.add, acc_sum, acc)
        return loss_sum, acc_sum
