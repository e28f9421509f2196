"""Local training of a cohort: every client's steps run in lockstep through one mapped step function.

A round is the algorithm's program (:mod:`fedmosaic.protocol.program`): phases, each with its batch plan
(``plans.py``) and run by one step runner (``steps.PhaseSteps._run_phase``), with per-client updates between phases
and probes at the received or the final parameters (``probes.py``). The jobs live in their own files: the batch
plans (``plans.py``), the forward pass and gradient functions (``objective.py``), the looped tail (``looped.py``),
the probes (``probes.py``), the lockstep step runner with packing and fused blocks (``steps.py``), the compile
fallback (``compiled.py``); this one schedules a cohort's round and its phases.

Ragged cohorts: a client's step count is E * ceil(n_k / B), so one large client sets the number of lockstep steps.
Clients that have finished are *packed out*: the mapped step only sees the active clients (re-packed whenever the
active set shrinks), so a finished client neither moves nor costs compute. Partial last batches are padded and
masked inside the loss. The client axis is cut into chunks of ``chunk_size`` to bound memory.

Two ways to run a step: *mapped* — the clients' objectives forward under ``torch.func.vmap``, one backward of their
sum for every client's gradient, one optimiser update of the stacked parameters — or *looped* — each active client
in turn with plain autograd (``torch.autograd.grad`` on its rows of the stacked parameters, views, updated in
place). The sequential backend loops always; the vectorized backend loops while fewer than ``loop_below`` clients
are active (``execution.py`` sets it: a vmapped step has a fixed framework overhead worth several plain
single-client steps). Both give the same numbers.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np
import torch

from ...errors import ConfigError
from ...protocol.algorithm import Algorithm
from ...protocol.context import TaskLoss
from ...protocol.program import RECEIVED, Phase, Probe, Step
from ...protocol.tree import tmap
from ..evaluate import judging
from ..mapping import for_each_client
from ..seeding import FINETUNE, SERVER, TASK_END, WARMUP, work_shares
from ..tensors import ClientTensors, cat_trees
from . import optim
from .augment import AugmentConfig
from .compiled import CompiledOrEager
from .looped import LOOP_ALWAYS, LoopedSteps
from .objective import TERMS, Objective
from .plans import SHARED, plan_phase
from .probes import Probes
from .steps import PhaseSteps


class Trained(NamedTuple):
    """A cohort's local training, stacked in the order of its clients."""

    uploads: dict  # what each client sends (``Algorithm.finish``)
    states: dict  # each client's new persistent state
    loss: torch.Tensor  # [n] the mean training loss over each client's steps
    steps: np.ndarray  # [n] the local steps each client took
    terms: dict  # per named part of the objective (``LocalContext.term``) its mean over each client's steps, [n]


class PhaseResult(NamedTuple):
    """A phase of a cohort's round: the trained trees and states, its batch plan, and per client the sum of its
    first update's losses, its steps and its accumulated statistics; ``own`` the per-client payload the later
    phases see (with the probes at the received parameters under ``RECEIVED``)."""

    params: dict
    states: dict
    plan: dict
    loss: torch.Tensor
    steps: np.ndarray
    acc: dict
    own: dict


class LocalTrainer(Objective, LoopedSteps, Probes, PhaseSteps):
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
                 channels_last: bool = False, extra: dict | None = None, compile_cache: tuple | None = None):
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
            failed: list = []  # why compiling failed here, once it has
            # ``compile_cache``: (a ``compiled.CompileCache``, this setting's key): graphs kept between processes
            cache, key = compile_cache or (None, None)
            if cache is not None:
                cache.enable()
            seen = None if cache is None else (lambda: cache.record(key))
            self._compiled = lambda fn: CompiledOrEager(fn, failed, seen)
            self._fused = self._compiled(self._k_steps)
            self._grads = self._compiled(self._default)

    @property
    def judging(self) -> tuple:
        """(the inputs' transform, samples per batch) this architecture's models are judged with
        (``evaluate.judging``: in the memory order they train in)."""
        return judging(self.transform, self.channels_last)

    def _each(self, fn, dims, fresh=False):
        return for_each_client(fn, dims, self.vectorize, fresh)

    # ---- a cohort's round -----------------------------------------------------------------------------
    def train(self, data: ClientTensors, clients: np.ndarray, payload: dict, states, buffers, *, lr: float,
              seed: int, round_idx: int, own: dict | None = None, program: list[Phase] | None = None,
              probes: list[Probe] = (), epochs: int | None = None, batch: int | None = None, stragglers: float = 0.0):
        """Train ``clients`` (their per-client payload ``own``, persistent ``states`` and model ``buffers`` stacked in
        the same order; the buffers — BatchNorm running statistics — are updated in place). ``program`` defaults to
        one phase of ``epochs`` (default: the trainer's) with ``batch``. ``stragglers``: the chance that a client
        runs only a share of its steps (``participation.stragglers``; ``seeding.work_shares``).

        Returns :class:`Trained`, stacked in the order of ``clients``.
        """
        program = program or [Phase(epochs=epochs, batch=batch)]
        if own is None:
            own = {"cid": torch.as_tensor(clients, device=data.x.device)}
        with self._threads():
            outs = [self._train_chunk(data, clients[sl], payload, *self._rows((own, states, buffers), sl), program,
                                      probes, lr, seed, round_idx, (), stragglers)
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
        with self._threads(), self._measuring():
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
        own = self._amp_on(own, len(clients), data.x.device)
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

    def _train_chunk(self, data, clients, payload, own, states, buffers, program, probes, lr, seed, round_idx, keys,
                     stragglers=0.0):
        n, dev = len(clients), data.x.device
        work = work_shares(clients, stragglers, seed, round_idx)
        params = self._init(payload, own, states)
        loss_sum, step_sum, acc_sum = torch.zeros(n, device=dev), np.zeros(n, dtype=np.int64), {}
        stats, first, terms = {}, None, {}
        for p, phase in enumerate(program):
            params, states, plan, loss, steps, acc, own = self._phase(
                data, clients, params, states, payload, own, buffers, phase, p, lr, seed, round_idx, keys,
                probes=[pr for pr in probes if pr.at == "received"] if p == 0 else [], stats=stats, work=work)
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

    def _plan(self, data, clients, phase: Phase, p: int, seed: int, round_idx: int, keys: tuple, work=None) -> dict:
        return plan_phase(data, clients, phase, p, seed, round_idx, keys, phase.batch or self.batch,
                          phase.epochs or self.epochs, self.augment, work)

    def _phase(self, data, clients, params, states, payload, own, buffers, phase, p, lr, seed, round_idx, keys,
               probes=(), stats=None, work=None):
        """Hooks, probes at the received parameters (first phase), the phase's steps."""
        own = self._amp_on(own, len(clients), data.x.device)
        if phase.before is not None:
            params, states = self._hook(phase.before)(params, states, payload, own)
        if phase.view.part == "public":
            if self.public is None:
                raise ConfigError(f"algorithm {self.algo.name!r} trains on the public stream: set data.public "
                                  "(e.g. {source: noise, size: 5000})")
            data = self.public
        plan = self._plan(data, clients, phase, p, seed, round_idx, keys, None if phase.view.part == "public" else work)
        for pr in probes:
            stats[pr.name] = self._probe(data, plan, params, states, payload, own, buffers, pr)
        if probes:  # the phases' objectives see them too (ctx.payload["own"][RECEIVED])
            own = {**own, RECEIVED: {pr.name: stats[pr.name] for pr in probes}}
        last = None if phase.until is None else torch.zeros(len(clients), device=data.x.device)
        loss, acc = self._run_phase(data, plan, params, states, payload, own, buffers, phase, lr, last)
        steps = plan["steps"]
        if phase.until is not None:
            steps = self._repeat(data, plan, params, states, payload, own, buffers, phase, lr, loss, acc, last)
        if phase.after is not None:
            params, states = self._hook(phase.after)(params, states, payload, own)
        return PhaseResult(params, states, plan, loss, steps, acc, own)

    def _hook(self, fn):
        key = ("hook", fn)
        if key not in self._fns:
            self._fns[key] = self._each(lambda p, s, shared, own: fn(p, s, {**shared, "own": own}), (0, 0, None, 0),
                                        fresh=True)
        return self._fns[key]







