"""Local training of a cohort: every client's steps run in lockstep through one mapped step function.

A round is the algorithm's program (:mod:`.program`): phases, each with its batch plan (built by :meth:`_plan`) and
run by one step runner (:meth:`_run_phase`), with per-client updates between phases and probes at the received or the
final parameters.

Ragged cohorts: a client's step count is E * ceil(n_k / B), so one large client sets the number of lockstep steps.
Clients that have finished are *packed out*: the mapped step only sees the active clients (re-packed whenever the
active set shrinks), so a finished client neither moves nor costs compute. Partial last batches are padded and
masked inside the loss. The client axis is cut into chunks of ``chunk_size`` to bound memory.

Two ways to run a step: *mapped* — the clients' objectives forward under ``torch.func.vmap``, one backward of their
sum for every client's gradient, one optimiser update of the stacked parameters — or *looped* — each active client in turn with plain autograd (``torch.autograd.grad``
on its rows of the stacked parameters, views, updated in place). The sequential backend loops always; the
vectorized backend loops while fewer than ``loop_below`` clients are active (``engine/execution.py`` sets it: a
vmapped step has a fixed framework overhead worth several plain single-client steps). Both give the same numbers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import numpy as np
import torch
from torch.func import functional_call, grad
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from ..errors import ConfigError
from ..protocol.algorithm import Algorithm
from ..protocol.context import LocalContext, TaskLoss
from ..protocol.program import Phase, Probe, Step, View
from ..protocol.tree import leaves, put, take, tmap
from . import augment, optim
from .augment import AugmentConfig
from .mapping import for_each_client
from .seeding import FINETUNE, SERVER, TASK_END, VIEWS, WARMUP, batch_plan, rng


class Trained(NamedTuple):
    """A cohort's local training, stacked in the order of its clients."""

    uploads: dict  # what each client sends (``Algorithm.finish``)
    states: dict  # each client's new persistent state
    loss: torch.Tensor  # [n] the mean training loss over each client's steps
    steps: np.ndarray  # [n] the local steps each client took
    terms: dict  # per named part of the objective (``LocalContext.term``) its mean over each client's steps, [n]


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


def view_offsets(view: View, n: int, seed: int, client: int, round_idx: int) -> np.ndarray:
    """The offsets (inside the client's train range) of the samples ``view`` selects for ``client``."""
    if view.part == "all":
        return np.arange(n)
    cut = min(n, int(np.ceil(view.frac * n)))
    if view.part == "sample":
        return np.sort(rng(seed, VIEWS, 1, round_idx, client).choice(n, size=cut, replace=False))
    order = rng(seed, VIEWS, 0, client).permutation(n)
    return np.sort(order[:cut] if view.part == "support" else order[cut:])


def _gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]`` for an index tensor of any shape (index_select: a fraction of advanced indexing's overhead)."""
    return t.index_select(0, idx.reshape(-1)).view(*idx.shape, *t.shape[1:])


#: The "client" whose batch order every client follows on the public stream (beyond any real client id).
SHARED = 2**40

#: Looped clients' batches are gathered this many steps at a time.
LOOP_BLOCK = 64

#: ``loop_below`` of the sequential path: every step is looped.
LOOP_ALWAYS = 2**62

#: The key of the objective's named parts (``LocalContext.term``) among a step's accumulated statistics.
TERMS = "_terms"


def _sub(params: dict, slots) -> dict:
    return params if slots is None else {k: params[k] for k in slots}


class LocalTrainer:
    """Runs the local rounds of a cohort for one architecture.

    Per step: the per-client gradient function (objective = the algorithm's terms) is mapped over the active
    clients — ``vmap`` on the fast path, a Python loop on the sequential one — and the optimiser then updates the
    stacked parameters of all of them in one in-place operation. With ``compile``, the mapped gradient function of
    the default phase is compiled with ``torch.compile``, and runs of ``fuse_steps`` steps during which no client
    finishes are compiled as one call (gradients and updates), which removes most of the per-step Python overhead
    that dominates long runs of tiny steps. The number of active clients is then padded to a power of two (padding
    rows are masked out and discarded) so that a run compiles a handful of shapes rather than one per cohort size.
    """

    def __init__(self, algo: Algorithm, module: torch.nn.Module, opt: optim.OptimizerConfig, task_loss: str,
                 transform, vectorize: bool = True, chunk_size: int = 128, compile: bool = False,
                 fuse_steps: int = 1, augment: AugmentConfig | None = None, pad_fill: torch.Tensor | float = 0.0,
                 epochs: int = 1, batch: int = 1, loop_below: int = 0, threads: int | None = None,
                 channels_last: bool = False, extra: dict | None = None):
        self.algo, self.module, self.opt, self.task_loss = algo, module, opt, task_loss
        self.extra = extra or {}  # slot -> its own architecture (Algorithm.extra_models)
        self.transform = transform
        self.augment = augment if augment is not None and augment.active else None
        self.pad_fill = pad_fill
        self.chunk_size = chunk_size
        self.epochs, self.batch = epochs, batch
        self.vectorize = vectorize
        self.loop_below = loop_below if vectorize else LOOP_ALWAYS
        self.threads = threads  # CPU threads while training (None: leave torch's setting)
        self.channels_last = channels_last  # looped steps: image batches in channels-last order (CPU convolutions)
        self.compile = compile and vectorize
        #: the shared public stream (noise or an unlabeled dataset; ``y`` holds each sample's index), if the run has one
        self.public: ClientTensors | None = None
        self.fuse = fuse_steps if self.compile else 1
        self._fns: dict = {}
        # functional_call looks for tied weights at every call (a third of a small model's step): only when tied
        self._ties = (len(list(module.named_parameters(remove_duplicate=False))) != len(list(module.parameters()))
                      or len(list(module.named_buffers(remove_duplicate=False))) != len(list(module.buffers())))
        self._has_buffers = any(True for _ in module.buffers())
        self._bound = None  # the parameter tree currently put in ``module`` (:meth:`_bound_to`)
        # one client's hooks, mapped: (params or payload, state, shared payload, own payload)
        self._init = self._each(lambda shared, own, state: algo.local_init({**shared, "own": own}, state),
                                (None, 0, 0), fresh=True)
        self._finish = self._each(lambda p, s, shared, own, st: algo.finish(p, s, {**shared, "own": own}, st),
                                  (0, 0, None, 0, 0), fresh=True)
        self._default = self._grad_fn(Step())
        self._grads = self._default
        if self.compile:
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self._fused = torch.compile(self._k_steps, dynamic=False)
            self._grads = torch.compile(self._default, dynamic=False)

    def _each(self, fn, dims, fresh=False):
        return for_each_client(fn, dims, self.vectorize, fresh)

    def apply(self, params, x, buffers=None, slot=None):
        """(features, logits); ``buffers`` (BatchNorm running statistics) are the client's, updated in place.
        ``slot``: a slot with an architecture of its own (``extra``) runs that module (it has no buffers)."""
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

    # ---- per-client functions -----------------------------------------------------------------------
    def _ctx(self, params, state, payload, x, y, mask, pair, buffers, full=False) -> LocalContext:
        return LocalContext(partial(self.apply, buffers=buffers), params, state, payload, x, y, mask, self.task_loss,
                            pair or None, full, self.frozen)

    def _grad_fn(self, step: Step, objective=None, with_acc: bool = True):
        """The mapped gradient function of one update (cached): grads of its slots, loss, accumulated stats."""
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
        grads = self._grad_list(loss.sum(), live)
        return pytree.tree_unflatten(grads, pytree.tree_structure(_sub(params, slots))), loss.detach(), acc

    def _client_grads(self, params, state, shared, own, x, y, mask, pair, buffers, objective, slots, with_acc):
        payload = {**shared, "own": own}
        held = {k: tmap(torch.detach, v) for k, v in params.items() if slots is not None and k not in slots}

        def f(p, b):  # buffers are an argument, not captured: torch.func allows in-place updates of inputs only
            ctx = self._ctx({**held, **p}, state, payload, x, y, mask, pair, b)
            loss = objective(ctx)
            return loss, (loss.detach(), self._stats(ctx) if with_acc else {})

        grads, (loss, acc) = grad(f, has_aux=True)(_sub(params, slots), buffers)
        return grads, loss, acc

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
        return self._grad_list(loss, live), loss.detach(), acc

    @staticmethod
    def _grad_list(loss: torch.Tensor, live: list) -> list:
        """d loss / d ``live``, with zeros for leaves the loss does not touch (as torch.func gives them)."""
        grads = torch.autograd.grad(loss, live, allow_unused=True) if loss.requires_grad else [None] * len(live)
        if any(g is None for g in grads):
            grads = [torch.zeros_like(p) if g is None else g for p, g in zip(live, grads, strict=True)]
        return list(grads)

    # ---- a cohort's round -----------------------------------------------------------------------------
    def train(self, data: ClientTensors, clients: np.ndarray, payload: dict, states, buffers, *, lr: float,
              seed: int, round_idx: int, own: dict | None = None, program: list[Phase] | None = None,
              probes: list[Probe] = (), epochs: int | None = None, batch: int | None = None):
        """Train ``clients`` (their per-client payload ``own``, persistent ``states`` and model ``buffers`` stacked in
        the same order; the buffers — BatchNorm running statistics — are updated in place). ``program`` defaults to
        one phase of ``epochs`` (default: the trainer's) with ``batch``.

        Returns :class:`Trained`, stacked in the order of ``clients``.
        """
        program = program or [Phase(epochs=epochs, batch=batch)]
        if own is None:
            own = {"cid": torch.as_tensor(clients, device=data.x.device)}
        with self._threads():
            outs = [self._train_chunk(data, clients[sl], payload, *self._rows((own, states, buffers), sl), program,
                                      probes, lr, seed, round_idx, ())
                    for sl in self._chunks(len(clients))]
        uploads, new_states, losses, steps, terms = zip(*outs)
        return Trained(cat_trees(list(uploads)), cat_trees(list(new_states)), torch.cat(losses), np.concatenate(steps),
                       cat_trees(list(terms)))

    def adapt(self, data: ClientTensors, clients: np.ndarray, payload: dict, own: dict, states, buffers, *,
              program: list[Phase], lr: float, seed: int, round_idx: int) -> dict:
        """The trainable trees after running ``program`` from ``local_init`` — nothing uploaded, no state kept, the
        buffers untouched (fine-tuning before evaluation). Its batches are drawn apart from training's."""
        outs = []
        with self._threads():
            for sl in self._chunks(len(clients)):
                o, s, b = self._rows((own, states, tmap(torch.clone, buffers)), sl)
                params = self._init(payload, o, s)
                for p, phase in enumerate(program):
                    params, s, *_ = self._phase(data, clients[sl], params, s, payload, o, b, phase, p, lr, seed,
                                                round_idx, (FINETUNE,))
                outs.append(params)
        return cat_trees(outs)

    def start(self, payload: dict, own: dict, states) -> dict:
        """The trainable trees the clients of ``states`` start a round from (``local_init``, mapped)."""
        return self._init(payload, own, states)

    def warm_up(self, data: ClientTensors, clients: np.ndarray, own: dict, states, buffers, *, epochs: int,
                lr: float, seed: int) -> dict:
        """Every client's own model (``states["model"]``) trained on its private data with the task loss for
        ``epochs`` epochs before the first round (the warm-up of model-heterogeneous FL); the buffers are updated in
        place. Returns the trained models, stacked."""
        phase = Phase(epochs=epochs, updates=(Step(("model",), TaskLoss()),))
        outs = []
        with self._threads():
            for sl in self._chunks(len(clients)):
                o, s, b = self._rows((own, states, buffers), sl)
                params, *_ = self._phase(data, clients[sl], {"model": tmap(torch.clone, s["model"])}, s, {}, o, b,
                                         phase, 0, lr, seed, 0, (WARMUP,))
                outs.append(params["model"])
        return cat_trees(outs)

    def server_train(self, model: dict, payload: dict, program: list[Phase], buffers: dict, *, lr: float, seed: int,
                     round_idx: int) -> dict:
        """The server's model (stacked as a cohort of one) trained by ``program`` with ``payload`` (batch orders of
        its own seed stream); returns it, stacked."""
        ids = np.array([SHARED + 1])
        own = {"cid": torch.as_tensor(ids, device=self.public.x.device)}
        params = {"model": tmap(torch.clone, model)}
        with self._threads():
            for p, phase in enumerate(program):
                params, *_ = self._phase(self.public, ids, params, {}, payload, own, buffers, phase, p, lr, seed,
                                         round_idx, (SERVER,))
        return params["model"]

    @torch.no_grad()
    def outputs(self, x: torch.Tensor, params: dict, buffers: dict, batch: int) -> torch.Tensor:
        """Logits [n, N, C] of each of a stack of models on the same inputs ``x`` (already transformed), in
        batches of ``batch`` (as the public stream is trained on; the buffers are copies, left untouched)."""
        fn = self._each(lambda p, b, xb: self.apply(p, xb, b)[1], (0, 0, None))
        with self._threads():
            return torch.cat([fn(params, tmap(torch.clone, buffers), x[lo : lo + batch])
                              for lo in range(0, len(x), batch)], 1)

    @torch.no_grad()
    def features(self, data: ClientTensors, clients: np.ndarray, params: dict, buffers: dict,
                 batch: int = 1024) -> list[torch.Tensor]:
        """Per client of ``clients`` the features of its samples ``data.available`` (all of its rows if there is no
        subset) under its own row of the stacked ``params`` (buffers: copies, left untouched)."""
        base = data.available(clients) or [np.arange(n) for n in data.sizes[clients]]
        out = []
        with self._threads():
            for i, (k, offs) in enumerate(zip(clients, base, strict=True)):
                p, b = tmap(lambda t, i=i: t[i], (params, tmap(torch.clone, buffers)))
                rows = torch.as_tensor(data.ptr[k] + offs, device=data.x.device)
                z = [self.apply(p, self.transform(data.x[rows[lo : lo + batch]]), b)[0]
                     for lo in range(0, len(rows), batch)]
                out.append(torch.cat(z) if z else torch.zeros(0, device=data.x.device))
        return out

    def probe_at(self, data: ClientTensors, clients: np.ndarray, params: dict, states, payload: dict, own: dict,
                 buffers, probes: list[Probe], *, seed: int, round_idx: int) -> dict:
        """``probes`` at the given trainable trees over one pass of each client's samples (``data.available``):
        what the end of a task measures (FedEWC's Fisher at the task's final model)."""
        plan = self._plan(data, clients, Phase(epochs=1), 0, seed, round_idx, (TASK_END,))
        with self._threads():
            return {pr.name: self._probe(data, plan, params, states, payload, own, buffers, pr) for pr in probes}

    @contextlib.contextmanager
    def _threads(self):
        """torch's intra-op threads set to ``self.threads`` while training (tiny steps lose to thread fork/join)."""
        before = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            if self.threads is not None:
                torch.set_num_threads(before)

    def _chunks(self, n: int):
        return [slice(lo, lo + self.chunk_size) for lo in range(0, n, self.chunk_size)]

    @staticmethod
    def _rows(trees, sl):
        return tmap(lambda t: t[sl], trees)

    def _train_chunk(self, data, clients, payload, own, states, buffers, program, probes, lr, seed, round_idx, keys):
        n, dev = len(clients), data.x.device
        params = self._init(payload, own, states)
        loss_sum, step_sum, acc_sum = torch.zeros(n, device=dev), np.zeros(n, dtype=np.int64), {}
        stats, first, terms = {}, None, {}
        for p, phase in enumerate(program):
            params, states, plan, loss, steps, acc = self._phase(
                data, clients, params, states, payload, own, buffers, phase, p, lr, seed, round_idx, keys,
                probes=[pr for pr in probes if pr.at == "received"] if p == 0 else [], stats=stats)
            first = first or (None if phase.view.part == "public" else plan)  # (probes read the client's data)
            loss_sum += loss
            step_sum += steps
            for name, total in acc.pop(TERMS, {}).items():  # a part's sum and the steps of the phases it is in
                old_total, old_steps = terms.get(name, (0, 0))
                terms[name] = (old_total + total, old_steps + steps)
            acc_sum = acc if not acc_sum else tmap(torch.add, acc_sum, acc)
        for pr in probes:
            if pr.at == "final":
                stats[pr.name] = self._probe(data, first, params, states, payload, own, buffers, pr)
        stats.update({
            "n": torch.as_tensor(data.counts(clients), dtype=torch.float32, device=dev),
            "steps": torch.as_tensor(step_sum, dtype=torch.float32, device=dev),
            "lr": torch.full((n,), float(lr), device=dev),
            "acc": acc_sum,
        })
        uploads, new_states = self._finish(params, states, payload, own, stats)
        mean_loss = loss_sum / torch.as_tensor(np.maximum(step_sum, 1), dtype=torch.float32, device=dev)
        per_step = {name: total / torch.as_tensor(np.maximum(k, 1), dtype=torch.float32, device=dev)
                    for name, (total, k) in terms.items()}
        return Trained(uploads, new_states, mean_loss, step_sum, per_step)

    # ---- one phase ---------------------------------------------------------------------------------------
    def _plan(self, data, clients, phase: Phase, p: int, seed: int, round_idx: int, keys: tuple) -> dict:
        """The phase's batches as device tensors, step-major (a step's slice is contiguous: torch.compile guards
        on strides): ``rows``/``mask`` [S, n, B], augmentation ``draws``, the paired batch's ``rows2``/``mask2``,
        and per client ``steps`` and ``per_epoch`` (numpy)."""
        dev, batch = data.x.device, phase.batch or self.batch
        public = phase.view.part == "public"
        base = None  # the samples each client may draw from (a subset of its rows: the current task), or all
        if public:  # one stream for everybody: the same samples in the same order for every client
            sizes, start = np.full(len(clients), len(data.y)), np.zeros(len(clients), dtype=np.int64)
        else:
            base, sizes, start = data.available(clients), data.counts(clients), data.ptr[clients]
        k = p if phase.key is None else phase.key
        keys = keys + ((k,) if k else ())  # schedule 0 (the first phase by default) is the single-phase order
        epochs = phase.epochs or self.epochs

        def rows_of(view, extra, steps, batch=batch):
            offs = None if view.part in ("all", "public") else [view_offsets(view, int(n), seed, int(k), round_idx)
                                                                for n, k in zip(sizes, clients, strict=True)]
            counts = sizes if offs is None else np.array([len(o) for o in offs], dtype=np.int64)
            who = np.full(len(clients), SHARED) if public else clients
            pos, valid, st = batch_plan(counts, who, epochs, batch, seed, round_idx, keys + extra, steps)
            if offs is not None:
                for i, o in enumerate(offs):
                    pos[i] = o[pos[i]] if len(o) else 0
            if base is not None:
                for i, b in enumerate(base):
                    pos[i] = b[pos[i]] if len(b) else 0
            rows = np.where(valid, start[:, None, None] + pos, start[:, None, None]).transpose(1, 0, 2).copy()
            mask = valid.transpose(1, 0, 2).copy()
            return (torch.as_tensor(rows, device=dev), torch.as_tensor(mask, dtype=torch.float32, device=dev),
                    st, -(-counts // batch))

        if phase.pair is not None and phase.pair.part == "next":  # batches of 2B, halved: D and D' never overlap
            rows, mask, steps, per_epoch = rows_of(phase.view, (), phase.steps, 2 * batch)
            plan = {"rows": rows[..., :batch].contiguous(), "mask": mask[..., :batch].contiguous(),
                    "rows2": rows[..., batch:].contiguous(), "mask2": mask[..., batch:].contiguous()}
        else:
            rows, mask, steps, per_epoch = rows_of(phase.view, (), phase.steps)
            plan = {"rows": rows, "mask": mask}
        plan.update(steps=steps, per_epoch=per_epoch, batch=batch)
        if phase.pair is not None and phase.pair.part != "next":
            rows2, mask2, *_ = rows_of(phase.pair, (1,), steps)
            short = len(rows) - len(rows2)  # clients with nothing to pair with (e.g. no query samples) take none
            plan["rows2"] = torch.cat([rows2, rows[:short]]) if short else rows2
            plan["mask2"] = torch.cat([mask2, torch.zeros_like(mask[:short])]) if short else mask2
        if self.augment is not None and not public:  # (the public stream is not augmented)
            plan["draws"] = augment.draw(self.augment, clients, steps, batch, data.x.shape[1:], seed, round_idx,
                                         keys).to(dev)
        return plan

    def _phase(self, data, clients, params, states, payload, own, buffers, phase, p, lr, seed, round_idx, keys,
               probes=(), stats=None):
        """Hooks, probes at the received parameters (first phase), the phase's steps."""
        if phase.before is not None:
            params, states = self._hook(phase.before)(params, states, payload, own)
        if phase.view.part == "public":
            if self.public is None:
                raise ConfigError(f"algorithm {self.algo.name!r} trains on the public stream: set data.public "
                                  "(e.g. {source: noise, size: 5000})")
            data = self.public
        plan = self._plan(data, clients, phase, p, seed, round_idx, keys)
        for pr in probes:
            stats[pr.name] = self._probe(data, plan, params, states, payload, own, buffers, pr)
        last = None if phase.until is None else torch.zeros(len(clients), device=data.x.device)
        loss, acc = self._run_phase(data, plan, params, states, payload, own, buffers, phase, lr, last)
        steps = plan["steps"]
        if phase.until is not None:
            steps = self._repeat(data, plan, params, states, payload, own, buffers, phase, lr, loss, acc, last)
        if phase.after is not None:
            params, states = self._hook(phase.after)(params, states, payload, own)
        return params, states, plan, loss, steps, acc

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

    def _hook(self, fn):
        key = ("hook", fn)
        if key not in self._fns:
            self._fns[key] = self._each(lambda p, s, shared, own: fn(p, s, {**shared, "own": own}), (0, 0, None, 0),
                                        fresh=True)
        return self._fns[key]

    def _run_phase(self, data, plan, params, states, payload, own, buffers, phase: Phase, lr, last=None):
        """The step runner: every step of the plan for the active clients, in lockstep; ``params`` and ``buffers``
        are updated in place. Returns the per-client sum of the first update's losses and of accumulated stats;
        ``last`` (if given) receives each client's first-update loss of its last step."""
        n, dev, steps = len(plan["steps"]), data.x.device, plan["steps"]
        fast = self.compile and phase.plain
        updates = list(dict.fromkeys(phase.updates))  # equal updates share one optimiser state
        fns = [self._grad_fn(u, with_acc=i == 0) if not (fast and i == 0) else self._grads
               for i, u in enumerate(phase.updates)]
        tensors = {k: v for k, v in plan.items() if isinstance(v, torch.Tensor)}
        loss_sum = torch.zeros(n, device=dev)
        acc_sum = None
        # ``packed`` holds the active clients' rows of everything indexed by client (first ``real`` rows; when
        # compiled, padded to a power of two with masked copies of the first so few shapes get compiled).
        # While every client is active and no padding is needed, it is the full trees themselves.
        active = np.arange(n)
        ia, real = torch.as_tensor(active, device=dev), n
        opt = [optim.init_state(self._opt(u), leaves(_sub(params, u.slots))) for u in updates]
        packed = (params, opt, states, buffers, own)
        finish_at = set(steps.tolist())
        S = int(steps.max()) if n else 0
        block0 = fused_until = 0  # steps block0..fused_until-1 run in fused blocks of ``self.fuse``
        s0 = 0  # plan tensors start at step s0
        for s in range(S):
            if s in finish_at or (s == 0 and fast and n & (n - 1)):
                now = np.flatnonzero(steps > s)
                if packed[0] is not params:  # write the finished clients' rows back
                    put((params, buffers), ia, tmap(lambda t: t[:real], (packed[0], packed[3])))
                keep = np.searchsorted(active, now)
                if fast:
                    keep = np.concatenate([keep, np.full((1 << (len(keep) - 1).bit_length()) - len(keep), keep[0])])
                keep = torch.as_tensor(keep, device=dev)
                packed = tuple(take(t, keep) for t in packed)
                # only the steps still to come: repacking then costs O(what remains), not O(the whole plan)
                tensors = {k: t[s - s0 :].index_select(1, keep) for k, t in tensors.items()}
                for k in ("mask", "mask2"):
                    if k in tensors:
                        tensors[k][:, len(now) :] = 0  # padding rows never count
                active, ia, real, s0 = now, torch.as_tensor(now, device=dev), len(now), s
            if not fast and real < self.loop_below:  # few clients left: the rest of the phase on the loop
                loss, acc, final = self._loop_rest(data, tensors, s, s0, packed, real, steps[active] - s,
                                                   phase.updates, updates, payload, lr)
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
                loss, acc = self._fused(p_, o_[0], st_, payload, own_, x, y, m, b_, torch.tensor(lr, device=dev),
                                        torch.tensor(s, device=dev))
            else:
                batch = self._batch(data, tensors, s - s0)
                for i, u in enumerate(phase.updates):
                    grads, l_, a_ = fns[i](p_, st_, payload, own_, *batch, b_)
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
        if packed[0] is not params:
            put((params, buffers), ia, tmap(lambda t: t[:real], (packed[0], packed[3])))
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

    def _loop_rows(self, packed, real, steps, updates, payload) -> list:
        """For each of the first ``real`` clients of ``packed``: its payload, state and buffers, and per update of
        ``steps`` the trees its objective sees, their autograd leaves, the leaves to update (views of the stacked
        parameters: updates land in them) and its optimiser state (views too). Made once per packing."""
        rows = []
        for j in range(real):
            p, o, st, b, own = tmap(lambda t, j=j: t[j], packed)
            per = [(*self._live(p, u.slots), o[updates.index(u)], u.objective or self.algo.loss) for u in steps]
            rows.append(({**payload, "own": own}, st, b, per))
        return rows

    def _loop_rest(self, data, tensors, s, s0, packed, real, left, steps, updates, payload, lr):
        """Every remaining step (``left[j]`` from step ``s`` on) of the first ``real`` clients of ``packed``,
        client after client — its parameters stay in cache, its batches are gathered ``LOOP_BLOCK`` steps at a
        time —, with plain autograd and in-place updates of its rows. Returns per client the sums of the first
        update's losses and of its accumulated stats over those steps, and that loss at its last step."""
        losses, accs, lasts = [], [], []
        for j, row in enumerate(self._loop_rows(packed, real, steps, updates, payload)):
            with self._bound_to(row[3]):
                ls, acs = self._loop_client(data, tensors, s, s0, j, int(left[j]), row, steps, lr)
            losses.append(torch.stack(ls).sum())
            lasts.append(ls[-1])
            accs.append(tmap(lambda *ts: torch.stack(ts).sum(0), *acs) if acs[0] else {})
        return (torch.stack(losses), (tmap(lambda *ts: torch.stack(ts), *accs) if accs[0] else {}),
                torch.stack(lasts))

    def _loop_client(self, data, tensors, s, s0, j, left, row, steps, lr):
        """The ``left`` steps from step ``s`` of packed client ``j``: its losses and stats of the first update."""
        payload, st, b, per = row
        ls, acs = [], []
        for lo in range(0, left, LOOP_BLOCK):
            hi = min(left, lo + LOOP_BLOCK)
            x, y, m, pair = self._batch(data, tensors, (slice(s - s0 + lo, s - s0 + hi), j))
            # a batch's real samples come first: a partial batch is cut to them instead of computing padding
            cut, full = self._cuts(m, x.shape[1])
            cut2 = self._cuts(pair[2], pair[0].shape[1])[0] if pair else None
            for k in range(hi - lo):
                xk, yk, mk = (x[k], y[k], m[k]) if cut[k] is None else (x[k, : cut[k]], y[k, : cut[k]],
                                                                          m[k, : cut[k]])
                pk = tuple(t[k] if cut2[k] is None else t[k, : cut2[k]] for t in pair)
                if self.channels_last:
                    xk, pk = self._nhwc(xk), tuple(self._nhwc(t) if i == 0 else t for i, t in enumerate(pk))
                for i, (u, (tree, live, flat, opt, objective)) in enumerate(zip(steps, per, strict=True)):
                    grads, loss, acc = self._autograd(tree, live, st, payload, xk, yk, mk, pk, b, objective, i == 0,
                                                      full[k])
                    self._update(u, flat, grads, opt, lr, s + lo + k)
                    if i == 0:
                        ls.append(loss)
                        acs.append(acc)
        return ls, acs

    @contextlib.contextmanager
    def _bound_to(self, per):
        """While one looped client trains: its ``model`` tree put in the module once, rather than swapped in and
        out by ``functional_call`` at every step (a sixth of a small model's step). Only for a phase of one update
        (several updates train different trees) of a model without buffers (they are passed along per call)."""
        tree = per[0][0].get("model") if len(per) == 1 and not self._has_buffers else None
        if tree is None:
            yield
            return
        with _reparametrize_module(self.module, tree, tie_weights=self._ties):
            self._bound = tree
            try:
                yield
            finally:
                self._bound = None

    @staticmethod
    def _nhwc(x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x

    def _cuts(self, mask: torch.Tensor, batch: int) -> tuple[list, list]:
        """Per step of ``mask`` [K, B]: the number of real samples when the batch is partial, else None; and
        whether every sample left after the cut is real. Not with buffers: BatchNorm's batch statistics have always
        included the padding rows, and keep doing so."""
        counts = mask.sum(1).to(torch.int64).tolist()
        if self._has_buffers:
            return [None] * len(counts), [c == batch for c in counts]
        return [c if 0 < c < batch else None for c in counts], [c > 0 for c in counts]

    def _batch(self, data, plan, at):
        """Inputs, labels and mask of the step(s) ``at`` and the paired batch's (or ()), transformed and
        augmented."""
        r = plan["rows"][at]
        x = self.transform(_gather(data.x, r))
        if "draws" in plan:
            x = augment.apply(self.augment, x, plan["draws"][at], self.pad_fill)
        if "rows2" not in plan:
            return x, _gather(data.y, r), plan["mask"][at], ()
        r2 = plan["rows2"][at]
        return (x, _gather(data.y, r), plan["mask"][at],
                (self.transform(_gather(data.x, r2)), _gather(data.y, r2), plan["mask2"][at]))

    def _probe(self, data, plan, params, states, payload, own, buffers, probe: Probe):
        """Per client: the mean squared minibatch gradient (``grad_sq``) or the gradient of the mean loss
        (``grad``) over its first batches of ``plan``."""
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
        for r, mk in zip(plan["rows"][:m], masks):
            # on copies of the buffers: these extra forward passes must not move the running statistics
            grads, _, _ = fn(params, states, payload, own, self.transform(data.x[r]), data.y[r], mk, (),
                             tmap(torch.clone, buffers))
            w = (mk.sum(1) > 0).to(mk.dtype) if probe.kind == "grad_sq" else mk.sum(1)
            part = tmap(lambda g: (g * g if probe.kind == "grad_sq" else g) * w.view(-1, *([1] * (g.dim() - 1))),
                        grads)
            total = part if total is None else tmap(torch.add, total, part)
            count += w
        if total is None:
            return tmap(torch.zeros_like, _sub(params, probe.slots))
        return tmap(lambda t: t / count.clamp(min=1).view(-1, *([1] * (t.dim() - 1))), total)

    @torch.no_grad()
    def _probe_sums(self, data, rows, masks, params, states, payload, own, buffers, fn):
        """Per client: the sums of ``fn(ctx)`` (a dict of per-batch sums) over the batches ``rows`` (masked)."""
        mapped = self._each(partial(self._client_sums, fn=fn), (0, 0, None, 0, 0, 0, 0, 0, 0))
        total = None
        for r, mk in zip(rows, masks):
            part = mapped(params, states, payload, own, self.transform(data.x[r]), data.y[r], mk, (),
                          tmap(torch.clone, buffers))  # (copies: these passes must not move running statistics)
            total = part if total is None else tmap(torch.add, total, part)
        return total

    def _client_sums(self, params, state, shared, own, x, y, mask, pair, buffers, fn):
        return tmap(torch.detach, fn(self._ctx(params, state, {**shared, "own": own}, x, y, mask, pair, buffers)))

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
