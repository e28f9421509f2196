"""A built experiment: data on the device, architecture groups, the algorithm, the client store and the server.

``Federation.round(t)`` runs one communication round; ``evaluate(t)`` measures it. Rounds, checkpoints and files
are the runner's business (runner.py).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from functools import cached_property, partial
from typing import NamedTuple

import numpy as np
import torch
from torch.utils._pytree import tree_structure

from ..config import RunConfig
from ..data.federated import FederatedData, build
from ..data.partition.tasks import task_streams
from ..errors import ConfigError, CorruptDataError, FedMosaicError
from ..models import head_keys
from ..protocol.algorithm import Algorithm, registered
from ..protocol.program import Setting, Signals
from ..protocol.tree import all_finite, leaves, nbytes, put, take, tmap, weighted_mean
from . import evaluate as ev
from . import memory as mem
from .augment import black
from .build import Group, build_extra, build_groups, build_public, client_inits, data_spec
from .calendar import TaskCalendar
from .execution import Execution, ModelFacts, RunFacts, choose, cpu_threads, step_profile
from .local import ClientTensors, LocalTrainer, Trained, cat_trees
from .mapping import for_each_client
from .preflight import (
    check_evaluation,
    check_memory_total,
    check_plans,
    check_slots,
    check_training_memory,
    memory_bytes,
    resolve_device,
)
from .seeding import MEMORY, POOL, TASKS, rng, sample_cohort
from .transforms import make_normalizer


class NonFiniteLoss(FedMosaicError):
    pass


def average_buffers(stacked: dict, weights: torch.Tensor) -> dict:
    """Weighted mean of float buffers (running mean/var); integer counters take the largest value."""
    return {k: weighted_mean({k: t}, weights)[k] if t.is_floating_point() else t.max(0).values
            for k, t in stacked.items()}


class GroupTrained(NamedTuple):
    """One architecture group's part of a round: its cohort members, their training, the buffers they started from."""

    group: Group
    members: np.ndarray
    out: Trained
    buffers: dict


class Federation:
    def __init__(self, cfg: RunConfig, fd: FederatedData | None = None, threads: int | None = None):
        """``threads``: the CPU threads a resumed run started with (``execution.cpu_threads``)."""
        self.cfg = cfg
        #: torch's CPU threads for the whole run: never more than the cores free for it (``execution.cpu_threads``)
        self.threads = cpu_threads(cfg.engine.threads, threads)
        torch.set_num_threads(self.threads.count)
        self.device = dev = resolve_device(cfg.engine.device)  # before any data is read
        self.fd = fd if fd is not None else build(data_spec(cfg))
        normalize = make_normalizer(cfg.data.normalize, self.fd.x["train"], dev)
        arrays = [self.fd.x[s] for s in ("train", "val", "test")]
        if self.fd.x_global is not None:
            arrays.append(self.fd.x_global)
        # Normalise everything once up front when it fits the budget, rather than at every step.
        preload = sum(a.size for a in arrays) * 4 <= cfg.engine.preload_mb * 2**20
        self.transform = (lambda x: x) if preload else normalize

        def tensor(x):
            t = torch.as_tensor(x, device=dev)
            if not preload:
                return t
            return normalize.all(t)

        self.split = {
            s: ClientTensors(tensor(self.fd.x[s]), torch.as_tensor(self.fd.y[s], device=dev), self.fd.ptr[s])
            for s in ("train", "val", "test")
        }
        self.global_test = None
        if self.fd.x_global is not None:
            self.global_test = (tensor(self.fd.x_global), torch.as_tensor(self.fd.y_global, device=dev))
        self.num_clients = self.fd.num_clients
        self.label_counts = self.fd.summary()["counts"]  # [K, C] train labels per client
        self.memory = memory_bytes(dev)
        self._check_data(cfg)
        self.pad_fill = black(normalize, self.fd.dataset.input_shape, dev) if cfg.data.augment.crop_padding else 0.0

        self.groups = build_groups(cfg, self.fd.dataset.input_shape, self.fd.num_classes, self.num_clients,
                                   self.memory, dev)
        dims = {g.module.feature_dim for g in self.groups}
        algo_cls = registered()[cfg.algorithm.name]
        algo_cfg = algo_cls.Config.model_validate(cfg.algorithm.params())
        if algo_cls.shares_features and len(dims) > 1:
            raise ConfigError(f"algorithm {cfg.algorithm.name!r} exchanges features, but the architectures' feature "
                              f"sizes differ ({sorted(dims)}): give each a common size with model options "
                              "'project: <d>'")
        check_evaluation(cfg, algo_cls.personalized, self.num_clients, len(self.split["test"].y) > 0)
        self.public = build_public(cfg, self.fd.dataset.input_shape, self.fd.x["train"].dtype == np.uint8,
                                   normalize if preload else None, dev)
        self.tasks = self._build_tasks(cfg)
        #: what the server knows of the task streams (``calendar.TaskCalendar``); None without ``data.tasks``
        self.calendar = None if self.tasks is None else TaskCalendar(
            [[(task, classes) for task, classes, _ in st] for st in self.tasks], cfg.data.tasks.rounds_per_task,
            self.fd.num_classes)
        #: per client its exemplar memory (``data.tasks.memory``): class -> offsets into its train rows, best first
        self.exemplars = [{} for _ in range(self.num_clients)] if self.tasks and cfg.exemplar_memory() else None
        #: ``train.optimizer.plateau``: the learning rate's scale, the best mean loss so far, rounds without progress
        self.plateau = {"scale": 1.0, "best": float("inf"), "bad": 0}
        pc, tc = cfg.train.optimizer.plateau, cfg.data.tasks
        if pc is not None and tc is not None and tc.rounds_per_task - pc.skip - 1 <= pc.patience:
            warnings.warn(f"train.optimizer.plateau: a task of {tc.rounds_per_task} rounds compares "
                          f"{max(0, tc.rounds_per_task - pc.skip)} losses (skip {pc.skip}), too few to exceed patience "
                          f"{pc.patience}: the learning rate is never reduced", stacklevel=2)
        self.extra = build_extra(cfg, algo_cls.extra_models(algo_cfg, cfg.model), len(self.groups),
                                 self.fd.dataset.input_shape, self.fd.num_classes, self.num_clients, self.memory, dev)
        setting = Setting(self.fd.num_classes, dims.pop() if len(dims) == 1 else 0, self.fd.num_clients,
                          cfg.train.optimizer,
                          cfg.train.local_epochs, self.batch, head_keys(self.groups[0].module),
                          {s: {k: v.detach().clone() for k, v in m.named_parameters()} for s, m in self.extra.items()},
                          cfg.train.rounds, tc.rounds_per_task if tc else 0, tc.n_tasks if tc else 0)
        self.algo = algo_cls(algo_cfg, setting)
        if self.algo.pooled:
            self._pool_train_split()
        self.server = self.algo.init_server([g.init for g in self.groups])
        check_plans(cfg, self.algo, self.server, self.num_clients, self.chunk, self.batch,
                    int(self.split["train"].sizes.max(initial=1)), None if self.public is None else len(self.public.y),
                    self.memory, self.device)
        self.group_of = np.zeros(self.num_clients, dtype=np.int64)
        self.row_of = np.zeros(self.num_clients, dtype=np.int64)
        for g in self.groups:
            self.group_of[g.clients] = g.gid
            self.row_of[g.clients] = np.arange(len(g.clients))
        own_init = cfg.model.init == "own" or (cfg.model.init == "auto" and cfg.model.heterogeneous is not None)
        for g in self.groups:
            one = self.algo.init_client(g.init)
            check_training_memory(g.module, g.init, len(g.clients), nbytes(one), self.chunk, self.memory, dev)
            if own_init:  # every client its own initialisation (seeded by client), through the same hook
                g.store = for_each_client(self.algo.init_client, (0,), False)(
                    client_inits(cfg, g, self.fd.dataset.input_shape, self.fd.num_classes, dev))
            else:
                g.store = tmap(lambda t, n=len(g.clients): t.unsqueeze(0).repeat(n, *([1] * t.dim())), one)
            g.execution = ex = self._choose_execution(g)
            # running statistics are updated in place during the forward pass, which vmap cannot do per client:
            # such groups take the sequential path (same results, no vmap)
            if g.global_buffers and cfg.engine.backend != "sequential":
                warnings.warn(f"model {g.module.__class__.__name__} has buffers (BatchNorm running statistics): "
                              "its clients train on the sequential path", stacklevel=2)
            g.trainer = LocalTrainer(self.algo, g.module, cfg.train.optimizer, cfg.model.task_loss, self.transform,
                                     ex.backend == "vectorized", cfg.engine.chunk_size, ex.compile, ex.fuse_steps,
                                     cfg.data.augment, self.pad_fill, cfg.train.local_epochs, self.batch,
                                     loop_below=ex.loop_below, threads=ex.threads, channels_last=ex.channels_last,
                                     extra=self.extra)
            g.trainer.public = self.public
            check_slots(self.algo, self.server, one, g.clients[:1])

    @property
    def execution(self) -> str:
        """How the run executes, in words (one group; several: each named), and on how many CPU threads."""
        described = [g.execution.describe() for g in self.groups]
        text = described[0] if len(set(described)) == 1 else "; ".join(
            f"{g.module.__class__.__name__}: {d}" for g, d in zip(self.groups, described, strict=True))
        return f"{text}; {self.threads}"

    def run_facts(self, g: Group, sample: int = 32) -> RunFacts:
        """The run's step profile for group ``g`` (``execution.RunFacts``), from up to ``sample`` of its cohorts
        (spread over the run) and the round program of the first round."""
        tc = self.cfg.train
        picks = np.unique(np.linspace(0, tc.rounds - 1, min(tc.rounds, sample)).astype(np.int64))
        cohorts = [c[self.group_of[c] == g.gid] for c in
                   (self.cohort(int(t)) for t in picks)]
        sizes = self.split["train"].sizes
        program = self.algo.program(0)
        active = np.zeros(0)
        for ph in program:
            batch = ph.batch or self.batch
            n = (sizes if ph.view.part == "all" else np.full(len(sizes), len(self.public.y))
                 if ph.view.part == "public" and self.public is not None
                 else np.minimum(sizes, np.ceil(ph.view.frac * sizes)))
            steps = (np.full(len(sizes), ph.steps) if ph.steps is not None
                     else (ph.epochs or tc.local_epochs) * -(-n.astype(np.int64) // batch))
            prof = np.asarray(step_profile(steps, cohorts, self.cfg.engine.chunk_size))
            active = np.pad(active, (0, max(0, len(prof) - len(active))))
            active[: len(prof)] += prof
        return RunFacts(tc.rounds, tuple(active.tolist()), all(ph.plain for ph in program), self.batch)

    def _choose_execution(self, g: Group) -> Execution:
        e = self.cfg.engine
        return replace(choose(e.backend, e.compile, e.fuse_steps, ModelFacts.of(g.module), self.device.type,
                              self.run_facts(g), threads=e.threads), cpu_threads=self.threads)

    def _pool_train_split(self) -> None:
        """Deal the pooled train samples out again at random, each client keeping its count (``Algorithm.pooled``)."""
        tr = self.split["train"]
        perm = torch.as_tensor(rng(self.cfg.seed, POOL).permutation(len(tr.y)), device=self.device)
        self.split["train"] = ClientTensors(tr.x[perm], tr.y[perm], tr.ptr)

    def _check_data(self, cfg: RunConfig) -> None:
        """What the config can only be checked against once the partition is known."""
        K, tc = self.num_clients, cfg.train
        if tc.clients_per_round > K:
            raise ConfigError(f"train.clients_per_round: must be <= the {K} clients of this partition "
                              f"(got {tc.clients_per_round})")
        cfg.data.augment.check(self.fd.dataset.input_shape)
        sizes = self.split["train"].sizes
        # a batch larger than the largest client is all padding: cap it (same results, no giant batch plans)
        self.batch = int(max(1, min(tc.batch_size, sizes.max(initial=1))))
        self.chunk = min(cfg.engine.chunk_size, tc.clients_per_round)  # clients trained at once

    def _build_tasks(self, cfg: RunConfig) -> list | None:
        """Per client its task stream (``data.tasks``): [(task id, classes, offsets inside its train rows)], in the
        order it meets them (one shared order: by task id; ``random``: the client's own)."""
        tc = cfg.data.tasks
        if tc is None:
            return None
        if self.global_test is None:
            raise ConfigError("data.tasks: class-incremental accuracy is measured on the dataset's test split, which "
                              "this data setting pools away; use data.pool: train")
        ptr = self.split["train"].ptr
        parts = [np.arange(ptr[k], ptr[k + 1]) for k in range(self.num_clients)]
        streams = task_streams(self.fd.y["train"], parts, tc.n_tasks, tc.tasks_per_client, rng(cfg.seed, TASKS),
                               tc.classes_per_task)
        if tc.order == "shared":
            streams = [sorted(st, key=lambda task: task[0]) for st in streams]
        longest = max(map(len, streams))
        if cfg.train.rounds > longest * tc.rounds_per_task:
            raise ConfigError(f"train.rounds: the longest client task stream ({longest} tasks of {tc.rounds_per_task} "
                              f"rounds) ends after round {longest * tc.rounds_per_task} (got {cfg.train.rounds})")
        mc = cfg.exemplar_memory()
        if mc is not None and mc.total is not None:
            check_memory_total(mc.total, "data.tasks.memory.total" if mc is tc.memory
                                     else f"algorithm.memory.total of {cfg.algorithm.name}",
                                     max(len(classes) for st in streams for _, classes, _ in st), longest)
        return [[(t, classes, rows - ptr[k]) for t, classes, rows in st] for k, st in enumerate(streams)]

    def train_split(self, t: int, memory: bool = True) -> ClientTensors:
        """What clients may train on in round ``t``: their whole train split, or their current task's samples and
        (``memory``) the samples their exemplar memory keeps. A client whose stream has ended has none."""
        tr = self.split["train"]
        if self.tasks is None:
            return tr
        stage = self.stage(t)

        def offsets(k: int, task: np.ndarray) -> np.ndarray:
            kept = self.exemplars[k] if memory and self.exemplars is not None else None
            return np.union1d(task, mem.offsets_of(kept)) if kept else task

        return replace(tr, subset={k: offsets(k, st[stage][2]) for k, st in enumerate(self.tasks) if stage < len(st)})

    def stage(self, t: int) -> int:
        return self.calendar.stage(t)

    def task_ends(self, t: int) -> bool:
        return self.calendar is not None and self.calendar.task_ends(t)

    def first_met(self, stage: int) -> np.ndarray:
        return self.calendar.first_met(stage)

    def seen_classes(self, stage: int) -> np.ndarray:
        return self.calendar.seen_classes(stage)

    def _track_plateau(self, t: int, loss: float) -> None:
        """``train.optimizer.plateau``: torch's ReduceLROnPlateau on the cohort's mean loss (relative threshold
        1e-4) from the ``skip``-th round (of the run, or of each task) on; a new task starts it afresh."""
        opt = self.cfg.train.optimizer
        if opt.plateau is None:
            return
        p, pc = self.plateau, opt.plateau
        if (t % self.cfg.data.tasks.rounds_per_task if self.tasks is not None else t) >= pc.skip:
            if loss < p["best"] * (1 - 1e-4):
                p["best"], p["bad"] = loss, 0
            else:
                p["bad"] += 1
            if p["bad"] > pc.patience:
                floor = pc.min_lr / opt.lr_at(t + 1)
                p["scale"], p["bad"] = min(p["scale"], max(p["scale"] * pc.factor, floor)), 0
        if self.task_ends(t):
            self.plateau = {"scale": 1.0, "best": float("inf"), "bad": 0}

    def _end_task(self, t: int) -> None:
        """The last round of a task is over: every client's memory keeps the best of the task's samples under the
        model it predicts with, the algorithm's task probes run over them and ``end_task`` updates its state."""
        stage, tr, dev = self.stage(t), self.split["train"], self.device
        task = self.train_split(t, memory=False)
        seen = torch.as_tensor(self.seen_classes(stage), dtype=torch.float32, device=dev)
        payload, probes = self.algo.broadcast(self.server, t), self.algo.task_probes()
        mc = self.cfg.exemplar_memory()
        how = self.algo.memory_select if mc is None or mc.select == "auto" else mc.select
        for g in self.groups:
            g.module.eval()  # features and probes at the running statistics, which they leave alone
            params, bufs = self._predictors(g, t)
            if self.exemplars is not None:
                for k, z in zip(g.clients, g.trainer.features(task, g.clients, params, bufs), strict=True):
                    st = self.tasks[k]
                    if stage >= len(st):
                        continue
                    offs = st[stage][2]
                    labels = tr.y[torch.as_tensor(tr.ptr[k] + offs, device=dev)].cpu().numpy()
                    new = {int(c): z[torch.as_tensor(labels == c, device=dev)] for c in np.unique(labels)}
                    self.exemplars[k] = mem.refresh(self.exemplars[k], new, {c: offs[labels == c] for c in new}, how,
                                                 mc.per_class, mc.total, rng(self.cfg.seed, MEMORY, stage, int(k)))
            stats = g.trainer.probe_at(task, g.clients, {"model": params}, g.store, payload, self._own(g.clients, t)[0],
                                       bufs, probes, seed=self.cfg.seed, round_idx=t) if probes else {}
            g.store = for_each_client(lambda s, p, st: self.algo.end_task(s, p, st, seen, payload), (0, 0, 0),
                                      g.trainer.vectorize, fresh=True)(g.store, params, stats)
            g.task_buffers = tmap(torch.clone, bufs)

    # ---- one round ---------------------------------------------------------------------------------
    def cohort(self, t: int) -> np.ndarray:
        """The clients of round ``t``: ``clients_per_round`` drawn among those with a task in that round's stage
        (a client whose task stream has ended drops out), or among all."""
        live = self.calendar.live(t) if self.calendar is not None else None
        return sample_cohort(self.num_clients, self.cfg.train.clients_per_round, self.cfg.seed, t, live)

    def round(self, t: int) -> dict:
        """Round ``t``: (round 0: every client's warm-up;) the cohort's logits on the public stream go up and the
        server's answer comes down (``Algorithm.exchanges``); the cohort trains (group by group); the server
        aggregates (and trains on the public stream: ``server_program``). Returns the round's metrics."""
        cohort = self.cohort(t)
        lr = self.algo.round_lr(self.server, t, self.cfg.train.optimizer.lr_at(t) * self.plateau["scale"])
        if t == 0 and self.cfg.train.warmup_epochs:
            self._warm_up(lr)
        exchanged, shared = 0, {}
        if self.algo.exchanges:  # outputs on the public stream go up first; the server's answer comes down below
            logits, members = self._public_logits(cohort, t)
            shared = self.algo.exchange(self.server, logits, torch.as_tensor(members, device=self.device), t)
            exchanged = nbytes(logits)
        payload = {**self.algo.broadcast(self.server, t), **shared}
        train = self.train_split(t)
        trained = [self._train_group(g, members, payload, lr, t, train) for g, members in self._by_group(cohort)]
        cohort = np.concatenate([r.members for r in trained])
        loss = torch.cat([r.out.loss for r in trained])
        self._check_finite(t, cohort, loss, [r.out.uploads for r in trained])
        for r in trained:
            self._write_back(r.group, r.members, r.out.states, r.buffers, train)
        up = self._cat_uploads([r.out.uploads for r in trained])
        steps = np.concatenate([r.out.steps for r in trained])
        weights = torch.as_tensor(train.counts(cohort), dtype=torch.float32, device=self.device)
        local = self._local_in_out(cohort, up) if self.cfg.eval.local_models else {}
        signals = Signals(torch.as_tensor(cohort, device=self.device), loss,
                          torch.as_tensor(steps, dtype=torch.float32, device=self.device), lr)
        self.server = self.algo.aggregate(self.server, up, weights, t, signals)
        phases = self.algo.server_program(self.server, t)
        if phases:
            self._server_train(phases, up, cohort, lr, t)
        self._track_plateau(t, float(loss.mean()))
        if self.task_ends(t):
            self._end_task(t)
        return {
            **local,
            "round": t,
            "lr": lr,
            "train_loss": float(loss.mean()),
            **self._terms([r.out.terms for r in trained]),
            "clients": len(cohort),
            "local_steps_max": int(steps.max(initial=0)),
            "bytes_down": ((self.algo.broadcast_bytes(payload) + self._buffer_bytes()) * len(cohort)
                           + nbytes(self._own(cohort)[1])),
            "bytes_up": self.algo.sent_bytes(up) + self._buffer_bytes() * len(cohort) + exchanged,
        }

    @staticmethod
    def _terms(groups: list[dict]) -> dict:
        """``terms``: each named part of the local objective, its mean over the cohort of the clients' mean over
        their steps (a client whose objective has no such part, in another architecture group, does not count)."""
        names = dict.fromkeys(n for g in groups for n in g)
        if not names:
            return {}
        return {"terms": {n: float(torch.cat([g[n] for g in groups if n in g]).mean()) for n in names}}

    def _cat_uploads(self, uploads: list) -> dict:
        """The architecture groups' uploads as one stack: they must share a layout (logits, prototypes, statistics;
        the weights of different architectures are never stacked)."""
        layouts = {(str(tree_structure(u)), tuple((tuple(t.shape[1:]), t.dtype) for t in leaves(u))) for u in uploads}
        if len(layouts) > 1:
            raise ConfigError(f"algorithm {self.cfg.algorithm.name!r} uploads differently shaped tensors from the "
                              "different architectures of model.heterogeneous; it needs one architecture")
        return cat_trees(uploads)

    def _warm_up(self, lr: float) -> None:
        """Before round 0: every client's own model trained on its private data (``train.warmup_epochs``)."""
        for g in self.groups:
            g.module.train()
            trained = g.trainer.warm_up(self.split["train"], g.clients, self._own(g.clients)[0], g.store, g.buffers,
                                        epochs=self.cfg.train.warmup_epochs, lr=lr, seed=self.cfg.seed)
            g.store = for_each_client(self.algo.after_warmup, (0,), False)({**g.store, "model": trained})

    def _public_logits(self, cohort: np.ndarray, t: int) -> tuple[torch.Tensor, np.ndarray]:
        """([n, N0, C] every cohort client's logits on the public stream at the parameters it starts the round
        from, the clients in that order — :meth:`_by_group`'s)."""
        payload, out, x = self.algo.broadcast(self.server, t), [], self.transform(self.public.x)
        by_group = list(self._by_group(cohort))
        for g, members in by_group:
            rows = torch.as_tensor(self.row_of[members], device=self.device)
            params = g.trainer.start(payload, self._own(members)[0], take(g.store, rows))
            g.module.train()
            out.append(g.trainer.outputs(x, params["model"], take(g.buffers, rows), self.batch))
        return torch.cat(out), np.concatenate([members for _, members in by_group])

    def _server_train(self, phases, uploads: dict, cohort: np.ndarray, lr: float, t: int) -> None:
        """The server's own training after aggregation (``Algorithm.server_program``): ``server["model"]`` trained
        on the public stream as a cohort of one, against the payload ``exchange`` makes of the uploaded models'
        logits on the stream."""
        g = self.groups[0]
        g.module.train()
        x = self.transform(self.public.x)
        logits = g.trainer.outputs(x, uploads["model"], g.global_buffers_like(len(cohort)), self.batch)
        shared = self.algo.exchange(self.server, logits, torch.as_tensor(cohort, device=self.device), t)
        one = tmap(lambda v: v.unsqueeze(0), self.server["model"])
        trained = g.trainer.server_train(one, {**self.algo.broadcast(self.server, t), **shared}, phases,
                                         g.global_buffers_like(1), lr=lr, seed=self.cfg.seed, round_idx=t)
        self.server = {**self.server, "model": tmap(lambda v: v[0], trained)}

    def _by_group(self, cohort: np.ndarray):
        for g in self.groups:
            members = cohort[self.group_of[cohort] == g.gid]
            if len(members):
                yield g, members

    def _own(self, clients: np.ndarray, t: int | None = None) -> tuple[dict, dict]:
        """(the per-client payload of ``clients`` with their ids — and in round ``t`` of a task stream the classes
        they are told of (:meth:`_classes`) —, the part the server really sends)."""
        ids = torch.as_tensor(clients, device=self.device)
        sent = self.algo.client_payload(self.server, ids)
        told = self._classes(clients, self.stage(t)) if t is not None and self.tasks is not None else {}
        return {**sent, "cid": ids, **told}, sent

    def _classes(self, clients: np.ndarray, stage: int) -> dict:
        """[n, C] 1/0 each: ``task_classes`` the classes of each client's task at ``stage``, ``memory_classes`` those
        its exemplar memory holds samples of, ``seen_classes`` those the federation has met by then — from which a
        classification term picks its output columns (``LocalContext.classes``). Metadata, not counted as sent."""
        n, C = len(clients), self.fd.num_classes
        task, kept = np.zeros((n, C), dtype=np.float32), np.zeros((n, C), dtype=np.float32)
        for i, k in enumerate(clients):
            st, memory = self.tasks[k], self.exemplars[k] if self.exemplars is not None else {}
            task[i, st[stage][1] if stage < len(st) else []] = 1
            kept[i, [c for c, offs in memory.items() if len(offs)]] = 1
        seen = np.repeat(self.seen_classes(stage)[None].astype(np.float32), n, 0)
        return {k: torch.as_tensor(v, device=self.device)
                for k, v in (("task_classes", task), ("memory_classes", kept), ("seen_classes", seen))}

    def _train_group(self, g: Group, members: np.ndarray, payload: dict, lr: float, t: int,
                     train: ClientTensors) -> GroupTrained:
        rows = torch.as_tensor(self.row_of[members], device=self.device)
        # global-model algorithms start the cohort from the server's running statistics
        bufs = g.global_buffers_like(len(members)) if self.algo.global_model else take(g.buffers, rows)
        own = self._own(members, t)[0]
        if g.global_buffers:  # the running statistics of the teachers a client may distil from (frozen copies)
            payload = {**payload, "global_buffers": g.global_buffers}
            own = {**own, "local_buffers": take(g.buffers, rows), "task_buffers": take(g.task_buffers, rows)}
        g.module.train()
        out = g.trainer.train(train, members, payload, take(g.store, rows), bufs, own=own,
                              program=self.algo.program(t), probes=self.algo.probes(t, payload), lr=lr,
                              seed=self.cfg.seed, round_idx=t)
        return GroupTrained(g, members, out, bufs)

    @staticmethod
    def _check_finite(t: int, cohort: np.ndarray, loss: torch.Tensor, uploads: list) -> None:
        bad = ~torch.isfinite(loss)
        if bad.any() or not all(all_finite(u) for u in uploads):
            who = cohort[bad.cpu().numpy()] if bad.any() else cohort
            raise NonFiniteLoss(f"round {t}: non-finite loss or update on clients {who.tolist()[:10]}")

    def _write_back(self, g: Group, members: np.ndarray, new_state: dict, bufs: dict, train: ClientTensors) -> None:
        rows = torch.as_tensor(self.row_of[members], device=self.device)
        put((g.store, g.buffers), rows, (new_state, bufs))
        if self.algo.global_model and g.global_buffers:
            w = torch.as_tensor(train.counts(members), dtype=torch.float32, device=self.device)
            g.global_buffers = average_buffers(bufs, w)

    def _local_in_out(self, cohort: np.ndarray, uploads: dict) -> dict:
        """In-local / out-local accuracy of the cohort's freshly trained models (global-model algorithms)."""
        if self.global_test is None or "model" not in uploads or not self.algo.global_model:
            return {}
        g = self.groups[0]
        g.module.eval()
        x, y = self.global_test
        acc = ev.local_class_accuracy(g.apply, {**uploads["model"], **g.global_buffers_like(len(cohort))}, x, y,
                                      self.fd.num_classes, self.transform, g.trainer.vectorize)
        in_acc, out_acc = ev.in_out_local(acc, self.label_counts[cohort])
        return {"local_in_acc": in_acc, "local_out_acc": out_acc}

    def _buffer_bytes(self) -> int:
        """Running statistics travel with a global model."""
        return nbytes(self.groups[0].global_buffers) if self.algo.global_model else 0

    # ---- evaluation --------------------------------------------------------------------------------
    def evaluate(self, round_idx: int = 0) -> dict:
        """Metrics after round ``round_idx`` (which also seeds any fine-tuning before evaluation)."""
        out: dict = {}
        ev_cfg = self.cfg.eval
        test = self.split["test"]
        gp = self.algo.global_params(self.server)
        sent = self.algo.broadcast(self.server, round_idx)  # what the clients predict with, beside their own state
        logits_fn = lambda z, logits: self.algo.eval_logits(z, logits, sent)  # noqa: E731
        for g in self.groups:
            g.module.eval()  # BatchNorm: use the running statistics, do not update them
        if gp is not None:
            g0 = self.groups[0]
            gp = {**gp, **g0.global_buffers}
            if ev_cfg.global_test and self.global_test is not None:
                x, y = self.global_test
                ok, ls = ev.score_samples(g0.apply, gp, x, y, self.transform, logits_fn)
                out["global"] = ev.global_metrics(ok, ls, y, self.fd.num_classes)
            for key, split in (("global_clients", test), ("global_val", self.split["val"])):
                if (ev_cfg.client_test or key == "global_val") and len(split.y):
                    ok, _ = ev.score_samples(g0.apply, gp, split.x, split.y, self.transform, logits_fn, False)
                    out[key] = ev.client_summary(ev.per_client_correct(ok, split.ptr), split.sizes)
        if ev_cfg.client_test and self.algo.personalized:
            # personal models on each client's own test split, and on its validation split for best-by-val
            splits = {k: sp for k, sp in (("personal", test), ("personal_val", self.split["val"])) if len(sp.y)}
            correct = {k: np.zeros(self.num_clients) for k in splits}
            cross = np.zeros((self.num_clients, self.num_clients)) if ev_cfg.cross_clients else None
            for g in self.groups if splits else ():
                mine = {**self._personal(g, round_idx), **g.buffers}
                apply = partial(g.apply, slot=self.algo.personal_slot)
                if cross is not None:
                    cross[g.clients] = ev.cross_correct(apply, mine, test.x, test.y, test.ptr, self.transform,
                                                        logits_fn, g.trainer.vectorize)
                for k, sp in splits.items():
                    if k == "personal" and cross is not None:  # the matrix's diagonal: measured already
                        correct[k][g.clients] = cross[g.clients, g.clients]
                        continue
                    correct[k][g.clients] = ev.personal_correct(apply, mine, sp.x, sp.y, sp.ptr, g.clients,
                                                                self.transform, logits_fn, g.trainer.vectorize)
            out.update({k: ev.client_summary(correct[k], sp.sizes) for k, sp in splits.items()})
            if cross is not None and len(test.y):
                out["cross"] = ev.cross_summary(cross, test.sizes)
                names = self.fd.dataset.group_names
                if self.cfg.data.partition.get("scheme") in ("natural", "domains") and names \
                        and len(names) == self.num_clients:
                    out["cross"]["names"] = list(names)  # one client per group: name the rows by the domain
        if self.tasks is not None:
            out["continual"] = self._continual(round_idx)
        report = self.algo.report(self.server, self._client_reports())
        if report:
            out["report"] = report
        return out

    def _continual(self, t: int) -> dict:
        """Class-incremental accuracy after round ``t``: the model(s) clients predict with — the global one, or each
        client's own (then the mean over clients) — on the global test samples of every class met so far, choosing
        among those classes only (no task id). ``tasks[j]``: on the classes first met in stage j (the accuracy
        matrix's row; for a shared task order, task j's classes).

        An evaluation makes at most ``eval.continual_sample`` predictions, so its cost stays flat as classes
        accumulate: beyond it each model judges its share of a fixed class-stratified order of the seen samples
        (``evaluate.deal``; recorded as ``sample``). Each class's accuracy over its judged samples then counts by
        the class's test size, as in the full evaluation, which it equals when every model judges every sample."""
        stage = self.stage(t)
        first = self.first_met(stage)
        x, y = self.global_test
        labels, C = self.fd.y_global, self.fd.num_classes
        unseen = torch.as_tensor(first > stage, device=self.device)

        sent = self.algo.broadcast(self.server, t)

        def masked(z, logits):
            return self.algo.eval_logits(z, logits, sent).masked_fill(unseen, float("-inf"))

        groups = self.groups[:1] if self.algo.global_model else self.groups
        n = 1 if self.algo.global_model else sum(len(g.clients) for g in groups)
        seen = np.flatnonzero(first[labels] <= stage)
        rows = ev.deal(labels, self._test_ranks, seen, n, self.cfg.eval.continual_sample)
        hits, lo = [], 0
        for g in groups:
            g.module.eval()
            k = 1 if self.algo.global_model else len(g.clients)
            params, bufs = self._predictors(g, t, k)
            mine = torch.as_tensor(rows[lo : lo + k], device=self.device)
            lo += k
            hits.append(ev.judged_correct(g.apply, {**params, **bufs}, x, y, mine, self.transform,
                                          g.trainer.vectorize, masked).cpu().numpy())
        acc = ev.judged_class_accuracy(rows, np.concatenate(hits), labels, C)
        size = np.bincount(labels, minlength=C) * ~np.isnan(acc)  # classes by their test sizes (judged ones)
        acc = np.nan_to_num(acc)

        def mean(classes):
            return float(size[classes] @ acc[classes] / size[classes].sum()) if size[classes].any() else None

        out = {"stage": stage, "task_end": self.task_ends(t), "seen_acc": mean(first <= stage),
               "tasks": [mean(first == j) for j in range(stage + 1)]}
        if rows.shape[1] < len(seen):
            out["sample"] = {"models": n, "per_model": rows.shape[1], "samples": len(np.unique(rows)),
                             "of": len(seen)}
        return out

    @cached_property
    def _test_ranks(self) -> np.ndarray:
        """Per global test sample its rank in its class (``evaluate.class_ranks``): fixed by the data seed, so a
        sampled continual evaluation judges the same samples for every method and evaluation."""
        return ev.class_ranks(self.fd.y_global, data_spec(self.cfg).seed)

    def _predictors(self, g: Group, t: int, n: int | None = None) -> tuple[dict, dict]:
        """(parameters, buffers) of the model each client of ``g`` predicts with, stacked: the global model
        (``n`` copies; default one per client), or its personal one."""
        n = len(g.clients) if n is None else n
        if self.algo.global_model:
            gp = self.algo.global_params(self.server)
            return tmap(lambda v: v.unsqueeze(0).repeat(n, *([1] * v.dim())), gp), g.global_buffers_like(n)
        return self._personal(g, t), g.buffers

    def _client_reports(self) -> dict:
        """Every client's ``client_report`` of its state, stacked in client order (none: {})."""
        if type(self.algo).client_report is Algorithm.client_report:
            return {}
        parts = [(g.clients, for_each_client(self.algo.client_report, (0,), g.trainer.vectorize)(g.store))
                 for g in self.groups]
        order = torch.as_tensor(np.argsort(np.concatenate([c for c, _ in parts]), kind="stable"), device=self.device)
        return tmap(lambda *ts: torch.cat(ts).index_select(0, order), *[r for _, r in parts])

    def _personal(self, g: Group, t: int) -> dict:
        """Every client's personal model in group ``g`` (stacked): fine-tuned from ``local_init`` when the
        algorithm fine-tunes before evaluation, else ``personal_params`` of its state and the server's."""
        phases, sent, own = self.algo.finetune(), self.algo.broadcast(self.server, t), self._own(g.clients)[0]
        if phases is not None:
            return g.trainer.adapt(self.split["train"], g.clients, sent, own, g.store, g.buffers, program=phases,
                                   lr=self.cfg.train.optimizer.lr_at(t), seed=self.cfg.seed, round_idx=t)["model"]
        return for_each_client(lambda s, o: self.algo.personal_params(s, {**sent, "own": o}), (0, 0),
                               g.trainer.vectorize)(g.store, own)

    # ---- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"server": self.server, "stores": [g.store for g in self.groups],
                "buffers": [(g.buffers, g.global_buffers, g.task_buffers) for g in self.groups],
                "memory": None if self.exemplars is None else [mem.pack(m) for m in self.exemplars],
                "plateau": dict(self.plateau)}

    def load_state_dict(self, state: dict) -> None:
        if self.exemplars is not None and (state.get("memory") is None or len(state["memory"]) != self.num_clients):
            raise ValueError("written without this run's exemplar memory")  # (before anything is replaced)
        self.server = state["server"]
        if self.exemplars is not None:
            self.exemplars = [mem.unpack(m) for m in state["memory"]]
        self.plateau = dict(state.get("plateau", self.plateau))
        # Checkpoints written before BatchNorm support carry no "buffers"; that is only
        # equivalent when the model has none.
        buffers = state.get("buffers")
        if buffers is None:
            if any(g.buffers or g.global_buffers for g in self.groups):
                raise CorruptDataError("checkpoint has no BatchNorm statistics but the model has buffers; "
                                       "it was written for a different model")
            buffers = [({}, {}, {})] * len(self.groups)
        for g, s, (b, gb, *tb) in zip(self.groups, state["stores"], buffers, strict=True):
            if not tb and b:  # written before teachers had statistics of their own
                raise CorruptDataError("checkpoint has no teacher BatchNorm statistics; it was written by an older "
                                       "fedmosaic")
            g.store, g.buffers, g.global_buffers, g.task_buffers = s, b, gb, (tb[0] if tb else {})
