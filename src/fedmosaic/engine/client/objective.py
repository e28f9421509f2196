"""What a step computes for one client, mapped over many: the forward pass of a client's parameters (or a
frozen teacher's), its ``LocalContext``, and the gradient functions of an update — mapped forward with one backward
for all (vectorized), ``torch.func.grad`` under vmap (compiled), or plain autograd per client (looped)."""

from __future__ import annotations

from functools import partial

import torch
from torch.func import functional_call, grad
from torch.utils import _pytree as pytree

from ...protocol.context import LocalContext
from ...protocol.program import Step
from ...protocol.tree import leaves, tmap

#: The key of the objective's named parts (``LocalContext.term``) among a step's accumulated statistics.
TERMS = "_terms"

#: ``engine.precision: fp16``: where each client's dynamic loss scale travels, in its ``own`` payload (so packing
#: and the looped path carry it with the client's other rows): {"scale": its scale, "good": finite steps in a row}.
AMP = "_amp"
#: A client's loss scale at the start of each phase (torch.amp.GradScaler's default) ...
SCALE_INIT = 2.0**16
#: ... doubled after this many finite steps in a row (GradScaler: 2000 — its scale lives for a whole training; a
#: client's lives for one round's phase, ~10-500 steps)
GROWTH_EVERY = 200


def _sub(params: dict, slots) -> dict:
    return params if slots is None else {k: params[k] for k in slots}


def _finite(grads: list, scale: torch.Tensor) -> torch.Tensor:
    """Per client (the shape of ``scale``: [n] stacked, [] one client) whether all its gradients are finite."""
    ok = torch.ones(scale.numel(), dtype=torch.bool, device=scale.device)
    for g in grads:
        ok &= g.reshape(scale.numel(), -1).isfinite().all(1)
    return ok.reshape(scale.shape)


class Objective:
    """The forward pass and gradient functions of :class:`~.local.LocalTrainer` (a part of it: it reads the
    trainer's module, algorithm, mapping and cache)."""

    #: ``engine.precision``'s autocast dtype (None: float32, no autocast)
    autocast: torch.dtype | None = None

    def apply(self, params, x, buffers=None, slot=None):
        """(features, logits); ``buffers`` (BatchNorm running statistics) are the client's, updated in place.
        ``slot``: a slot with an architecture of its own (``extra``) runs that module (it has no buffers).
        Under ``engine.precision`` the forward pass runs in autocast and its outputs come back as float32: every
        loss, softmax, distance and norm an objective computes from them is float32 (the forward's matrix
        products and convolutions are where lower precision pays; a loss over logits costs little)."""
        if self.autocast is None:
            return self._forward(params, x, buffers, slot)
        with torch.autocast(x.device.type, dtype=self.autocast):
            out = self._forward(params, x, buffers, slot)
        return tmap(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)

    def _forward(self, params, x, buffers, slot):
        if slot in self.extra:
            return functional_call(self.extra[slot], params, (x,), {"with_features": True})
        if params is self._bound:  # a looped client's parameters, already in the module (:meth:`_bound_to`)
            return self.module(x, with_features=True)
        return functional_call(self.module, {**params, **(buffers or {})}, (x,), {"with_features": True},
                               tie_weights=self._ties)

    def frozen(self, params, x, buffers=None):
        """(features, logits) of a teacher: no gradient, and with BatchNorm in eval mode on the teacher's own
        running statistics ``buffers``, which nothing updates (:meth:`LocalContext.teacher`)."""
        with torch.no_grad():
            if not self._has_buffers:  # eval and train mode compute the same: no mode switch, nothing to pass
                return self.apply(params, x)
            if not buffers:
                raise ValueError("a teacher of a model with buffers (BatchNorm) needs its running statistics")
            was = self.module.training
            self.module.eval()
            try:
                return self.apply(params, x, buffers)
            finally:
                self.module.train(was)

    def _ctx(self, params, state, payload, x, y, mask, pair, buffers, full=False) -> LocalContext:
        return LocalContext(partial(self.apply, buffers=buffers), params, state, payload, x, y, mask, self.task_loss,
                            pair or None, full, self.frozen)

    def _grad_fn(self, step: Step, objective=None, with_acc: bool = True, compiled: bool = False):
        """The mapped gradient function of one update (cached): grads of its slots, loss, accumulated stats.
        ``compiled``: through ``torch.compile`` (the compiled path's updates other than the default one)."""
        if compiled:
            key = ("compiled", step, objective, with_acc)
            if key not in self._fns:
                self._fns[key] = self._compiled(self._grad_fn(step, objective, with_acc))
            return self._fns[key]
        key = (step, objective, with_acc)
        if key not in self._fns:
            objective = objective or step.objective or self.algo.loss
            dims = (0, 0, None, 0, 0, 0, 0, 0, 0)
            if self.vectorize and not self.compile:  # the objectives mapped forward, one backward for all clients
                fwd = self._each(partial(self._client_loss, objective=objective, with_acc=with_acc), dims)
                self._fns[key] = partial(self._stacked_grads, fwd, slots=step.slots)
            else:  # compiled: torch.func.grad under vmap (what torch.compile traces); looped: plain autograd
                fn = partial(self._client_grads if self.vectorize else self._client_autograd, objective=objective,
                             slots=step.slots, with_acc=with_acc)
                self._fns[key] = self._each(fn, dims)
        return self._fns[key]

    def _client_loss(self, params, state, shared, own, x, y, mask, pair, buffers, objective, with_acc):
        """One client's objective and accumulated stats (mapped forward of :meth:`_stacked_grads`)."""
        ctx = self._ctx(params, state, {**shared, "own": own}, x, y, mask, pair, buffers)
        loss = objective(ctx)
        return loss, (self._stats(ctx) if with_acc else {})

    def _stacked_grads(self, fwd, params, state, shared, own, x, y, mask, pair, buffers, slots):
        """Every client's gradient at once: the objectives mapped forward, then one backward of their sum, whose
        gradient in each client's rows is that client's own (the clients share no parameter) — the numbers of
        ``vmap(grad(...))`` without functorch's wrapping at every step (and its one-second import of
        torch._dynamo on the first call)."""
        tree, live, _ = self._live(params, slots)
        with torch.enable_grad():
            loss, acc = fwd(tree, state, shared, own, x, y, mask, pair, buffers)
        scale = own[AMP]["scale"] if AMP in own else None
        grads = self._grad_list((loss if scale is None else loss * scale).sum(), live)
        if scale is not None:
            grads = [g / scale.view(-1, *[1] * (g.dim() - 1)) for g in grads]
        return pytree.tree_unflatten(grads, pytree.tree_structure(_sub(params, slots))), loss.detach(), acc

    def _client_grads(self, params, state, shared, own, x, y, mask, pair, buffers, objective, slots, with_acc):
        payload = {**shared, "own": own}
        held = {k: tmap(torch.detach, v) for k, v in params.items() if slots is not None and k not in slots}
        scale = own[AMP]["scale"] if AMP in own else None

        def f(p, b):  # buffers are an argument, not captured: torch.func allows in-place updates of inputs only
            ctx = self._ctx({**held, **p}, state, payload, x, y, mask, pair, b)
            loss = objective(ctx)
            return loss if scale is None else loss * scale, (loss.detach(), self._stats(ctx) if with_acc else {})

        grads, (loss, acc) = grad(f, has_aux=True)(_sub(params, slots), buffers)
        return (grads if scale is None else tmap(lambda g: g / scale, grads)), loss, acc

    def _client_autograd(self, params, state, shared, own, x, y, mask, pair, buffers, objective, slots, with_acc):
        """:meth:`_client_grads` of one client with plain autograd (the looped mapped function: probes, and every
        gradient on the sequential path)."""
        tree, live, _ = self._live(params, slots)
        grads, loss, acc = self._autograd(tree, live, state, {**shared, "own": own}, x, y, mask, pair, buffers,
                                          objective, with_acc)
        return pytree.tree_unflatten(grads, pytree.tree_structure(_sub(params, slots))), loss, acc

    def _stats(self, ctx: LocalContext) -> dict:
        """What a step adds up over the round (detached): the algorithm's ``accumulate`` and, under ``TERMS``, the
        named parts of its objective (``ctx.term``)."""
        acc = self.algo.accumulate(ctx)
        if ctx.terms:
            acc = {**acc, TERMS: ctx.terms}
        return tmap(torch.detach, acc)

    @staticmethod
    def _live(params, slots):
        """(the trainable trees as an objective sees them, the leaves of ``slots`` in it — autograd leaves that
        share memory with ``params`` —, the leaves of ``slots`` in ``params``) for one client."""
        flat, spec = pytree.tree_flatten(_sub(params, slots))
        live = [t.detach().requires_grad_() for t in flat]
        held = {k: v for k, v in params.items() if slots is not None and k not in slots}
        return {**held, **pytree.tree_unflatten(live, spec)}, live, flat

    def _autograd(self, tree, live, state, payload, x, y, mask, pair, buffers, objective, with_acc, full=False):
        """Gradients (a list, zeros for leaves the objective does not touch, as with torch.func), loss and
        accumulated stats of one client, with plain autograd: the numbers of :meth:`_client_grads` without
        functorch's wrapping, which costs more than the whole step of a small model. ``full``: no padding in
        the batch."""
        with torch.enable_grad():
            ctx = self._ctx(tree, state, payload, x, y, mask, pair, buffers, full)
            loss = objective(ctx)
            acc = self._stats(ctx) if with_acc else {}
        amp = payload["own"].get(AMP)
        if amp is None:
            return self._grad_list(loss, live), loss.detach(), acc
        return [g / amp["scale"] for g in self._grad_list(loss * amp["scale"], live)], loss.detach(), acc

    def _amp_on(self, own: dict, n: int, device) -> dict:
        """``own`` with a fresh loss scale per client under ``engine.precision: fp16`` (kept if it has one)."""
        if self.autocast is not torch.float16 or AMP in own:
            return own
        return {**own, AMP: {"scale": torch.full((n,), SCALE_INIT, device=device),
                             "good": torch.zeros(n, dtype=torch.int64, device=device)}}

    def _scaled(self, compute, own: dict, buffers, live=None):
        """``compute()``'s (gradients, loss, stats) under fp16's dynamic loss scale (``own[AMP]``, one scale per
        client, updated in place; without one, just ``compute()``). The loss is multiplied by the scale before the
        backward pass (fp16 gradients of small values would underflow to zero) and the gradients divided by it
        after (exact: the scales are powers of two). A client whose gradients are not finite has overflowed: its
        scale is halved and the step computed again — not skipped, as torch.amp.GradScaler does, since a skipped
        step would change the number of local steps a client took, which algorithms count (FedNova's tau,
        SCAFFOLD's K) — with the model's buffers (BatchNorm statistics, which the forward pass moves) as they were
        before the step. Gradients still not finite at a scale of 1 are returned as they are (the model itself
        diverged, as it would in float32). After ``GROWTH_EVERY`` finite steps in a row a scale doubles; ``live`` (per
        client, default all): the clients whose batch this is, the others' padding step counting for nothing (a
        probe's stacked pass: the looped one takes no such step)."""
        amp = own.get(AMP)
        if amp is None:
            return compute()
        scale, good = amp["scale"], amp["good"]
        saved = tmap(torch.clone, buffers) if self._has_buffers and buffers else None
        while True:
            grads, loss, acc = compute()
            ok = _finite(leaves(grads), scale)
            again = ~ok & (scale > 1)
            if not bool(again.any()):
                break
            scale.copy_(torch.where(again, scale / 2, scale))
            if saved is not None:
                tmap(lambda b, v: b.copy_(v), buffers, saved)
        counted = torch.where(ok, good + 1, 0)
        good.copy_(counted if live is None else torch.where(live, counted, good))
        grow = good >= GROWTH_EVERY
        scale.copy_(torch.where(grow, scale * 2, scale))
        good.masked_fill_(grow, 0)
        return grads, loss, acc

    @staticmethod
    def _grad_list(loss: torch.Tensor, live: list) -> list:
        """d loss / d ``live``, with zeros for leaves the loss does not touch (as torch.func gives them)."""
        grads = torch.autograd.grad(loss, live, allow_unused=True) if loss.requires_grad else [None] * len(live)
        if any(g is None for g in grads):
            grads = [torch.zeros_like(p) if g is None else g for p, g in zip(live, grads, strict=True)]
        return list(grads)
