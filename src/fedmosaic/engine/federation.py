"""A built experiment: data on the device, architecture groups, the algorithm, the server side and the client pool.

``Federation.round(t)`` runs one communication round; ``evaluate(t)`` measures it. Rounds, checkpoints and files
are the runner's business (runner.py).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from functools import cached_property

import numpy as np
import torch

from ..config import RunConfig
from ..data.federated import FederatedData, build
from ..data.partition.tasks import task_streams
from ..errors import ConfigError, CorruptDataError
from ..models import head_keys, norm_keys
from ..protocol.algorithm import Algorithm, registered
from ..protocol.program import Setting
from ..protocol.tree import nbytes, take
from . import evaluate as ev
from . import robust
from .augment import black
from .build import (
    Group,
    build_extra,
    build_groups,
    build_public,
    check_models_fit,
    client_store,
    data_spec,
    make_trainer,
)
from .calendar import TaskCalendar
from .client import ClientRuntime, Hosted, ids_of, order_parts
from .execution import Execution, ModelFacts, RunFacts, choose, cpu_threads, step_profile
from .pools import InProcessPool, WirePool, traffic
from .preflight import (
    activation_bytes,
    check_evaluation,
    check_memory_total,
    check_plans,
    check_precision,
    check_slots,
    check_training_memory,
    memory_bytes,
    precision,
    resolve_device,
)
from .seeding import POOL, TASKS, rng
from .server import ServerRuntime
from .tensors import ClientTensors
from .transforms import make_normalizer


class Federation:
    """A run in one process: it builds the data, the architecture groups and the algorithm, then drives every
    round as messages between the server side (``server.ServerRuntime``: server state, BatchNorm statistics,
    schedule, cohorts, exchange, aggregation) and the clients in a pool (``pools``: client runtimes), and
    evaluates. Neither side touches the other's state; this class only carries the messages and keeps the
    simulation's view (the global test set, the clients' label histograms for in/out-local accuracy)."""

    def __init__(self, cfg: RunConfig, fd: FederatedData | None = None, threads: int | None = None,
                 pool=None):
        """``threads``: the CPU threads a resumed run started with (``execution.cpu_threads``). ``pool`` (default
        ``engine.pool``): ``local``, every client in this process's one runtime; ``wire``, each client in a runtime
        of its own, every message through the codec (``pools.WirePool``); ``ray``, shards of clients on Ray actors
        (``raypool.RayPool``); ``none``, no clients here (a process that hosts some itself: :meth:`client_runtime`
        — a Ray actor, a Flower node); or a function of this federation that makes the pool (a deployment's:
        ``deploy.server.FlowerPool``, whose clients keep their state on their nodes: ``pool.remote``). Only the
        local pool's clients have their state in this process."""
        self.cfg = cfg
        #: torch's CPU threads for the whole run: never more than the cores free for it (``execution.cpu_threads``)
        self.threads = cpu_threads(cfg.engine.threads, threads)
        torch.set_num_threads(self.threads.count)
        self.device = dev = resolve_device(cfg.engine.device)  # before any data is read
        precision(cfg.engine.deterministic, cfg.engine.tf32, dev)
        check_precision(cfg.engine.precision, dev)
        robust.check(cfg, registered()[cfg.algorithm.name])  # before any data are read
        budget = lambda: memory_bytes(dev) if cfg.engine.memory_mb is None else cfg.engine.memory_mb * 2**20  # noqa
        if fd is None:  # a model that cannot fit is refused before the data are laid out (a copy of the dataset)
            spec = data_spec(cfg)
            spec.canonical()  # a bad partition is named before any data are read
            ds = spec.load()
            check_models_fit(cfg, ds.input_shape, ds.num_classes, budget(), dev, None)
            fd = build(spec, ds)
        self.fd = fd
        check_models_fit(cfg, self.fd.dataset.input_shape, self.fd.num_classes, budget(), dev,
                         int(max(1, min(cfg.train.batch_size, self.fd.sizes().max(initial=1)))))
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
        self.split["train"] = robust.flip_labels(cfg, self.split["train"], self.fd.num_classes)
        #: the held-out samples of the global evaluations and their labels: the test split, or (``eval.split: val``)
        #: the clients' validation splits pooled
        held = (self.fd.x["val"], self.fd.y["val"]) if cfg.eval.split == "val" else (self.fd.x_global, self.fd.y_global)
        self.global_labels = held[1]
        self.global_test = None
        if held[0] is not None:
            self.global_test = (tensor(held[0]), torch.as_tensor(held[1], device=dev))
        self.num_clients = self.fd.num_clients
        self.label_counts = self.fd.summary()["counts"]  # [K, C] train labels per client
        self.memory = budget()  # (on a GPU: what is free once the data are there)
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
        # per client its exemplar memory (``data.tasks.memory``): class -> offsets into its train rows, best first
        exemplars = [{} for _ in range(self.num_clients)] if self.tasks and cfg.exemplar_memory() else None
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
                          cfg.train.rounds, tc.rounds_per_task if tc else 0, tc.n_tasks if tc else 0,
                          self.groups[0].init, norm_keys(self.groups[0].module))
        self.algo = algo_cls(algo_cfg, setting)
        if self.algo.pooled:
            self._pool_train_split()
        #: the server side of every round (``server.ServerRuntime``)
        self.srv = ServerRuntime(cfg, self.algo, self.groups, self.num_clients, self.calendar, self.public,
                                 self.transform, self.batch, dev)
        # the batch plans are drawn on the host, then copied to the device: both must hold them
        for memory, where in [(self.memory, dev)] + ([] if dev.type == "cpu" else
                                                     [(memory_bytes(torch.device("cpu")), torch.device("cpu"))]):
            check_plans(cfg, self.algo, self.server, self.num_clients, self.chunk, self.batch,
                        int(self.split["train"].sizes.max(initial=1)),
                        None if self.public is None else len(self.public.y), memory, where)
        shape, C = self.fd.dataset.input_shape, self.fd.num_classes
        #: every client, hosted in this process (its groups' stores and trainers are set up below)
        self.runtime = ClientRuntime(cfg, self.algo, self.groups, self.split, self.num_clients, C, self.batch,
                                     self.transform, self.public, dev, self.tasks, exemplars, self.global_test)
        #: per client its architecture and its row in that group's store
        self.group_of, self.row_of = self.runtime.group_of, self.runtime.row_of
        pool = cfg.engine.pool if pool is None else pool
        if pool not in ("local", "wire", "ray", "none") and not callable(pool):
            raise ValueError(f"pool: 'local', 'wire', 'ray' or 'none' (got {pool!r})")
        for g in self.groups:
            one = self.algo.init_client(g.init)
            g.execution = ex = self._choose_execution(g)
            g.activations = activation_bytes(g.module, shape, self.batch)
            if pool == "local":  # every client's state in this process; another pool's runtimes hold their own
                check_training_memory(g.module, g.init, len(g.clients), nbytes(one), self._at_once(ex),
                                      self.memory, dev, g.activations)
                g.store = client_store(cfg, self.algo, g, one, shape, C, dev)
            # running statistics are updated in place during the forward pass, which vmap cannot do per client:
            # such groups take the sequential path (same results, no vmap)
            if g.global_buffers and cfg.engine.backend != "sequential":
                warnings.warn(f"model {g.module.__class__.__name__} has buffers (BatchNorm running statistics): "
                              "its clients train on the sequential path", stacklevel=2)
            g.trainer = make_trainer(cfg, self.algo, g.module, ex, self.transform, self.pad_fill, self.batch,
                                     self.extra, self.public)
            check_slots(self.algo, self.server, one, g.clients[:1])
        if pool != "local" and cfg.eval.cross_clients:
            raise ConfigError("eval.cross_clients: the K x K matrix needs every client's test split in one process; "
                              "it is measured with engine.pool: local only")
        if pool == "ray":
            from .raypool import RayPool

            pool = RayPool
        self.pool = (InProcessPool(self.runtime) if pool == "local" else self._wire_pool() if pool == "wire"
                     else None if pool == "none" else pool(self))

    def _wire_pool(self, shards: list | None = None) -> WirePool:
        """One runtime per client (or per shard of client ids): :meth:`client_runtime`."""
        shards = [np.sort(np.asarray(s, dtype=np.int64)) for s in
                  (shards if shards is not None else [[k] for k in range(self.num_clients)])]
        hosted = [Hosted(tuple((g.gid, mine) for g in self.groups if len(mine := self._of_group(g, ids))),
                         self.exemplars is not None) for ids in shards]
        # built at once: the runtimes of a round's cohort (each of its messages reaches them all)
        return WirePool(self.client_runtime, shards, hosted, self.algo, self.device, self.cfg.train.clients_per_round)

    def _of_group(self, g: Group, ids: np.ndarray) -> np.ndarray:
        """The clients of ``g`` among the sorted ``ids`` (without sorting the group's clients again: a wire pool of
        10,000 clients asks once per client)."""
        return ids[self.runtime.group_of[ids] == g.gid]

    def client_runtime(self, shard) -> ClientRuntime:
        """A runtime of the clients ``shard``, built as a device would build it: its own modules (from the run's
        seeds), its own store and trainer (run as this process's architecture groups are), and its own rows of the
        data — what a wire pool's runtime, or a deployed node, hosts."""
        cfg, shape, C, dev = self.cfg, self.fd.dataset.input_shape, self.fd.num_classes, self.device
        ids, algo = np.sort(np.asarray(shard, dtype=np.int64)), type(self.algo)(self.algo.cfg, self.algo.setting)
        fresh = build_groups(cfg, shape, C, self.num_clients, self.memory, dev)
        groups = []
        for g, full in zip(fresh, self.groups, strict=True):
            mine = self._of_group(full, ids)
            if not len(mine):
                continue
            mine = Group(g.gid, g.module, mine)
            one = algo.init_client(mine.init)
            check_training_memory(g.module, mine.init, len(mine.clients), nbytes(one),
                                  min(self._at_once(full.execution), len(mine.clients)), self.memory, dev,
                                  full.activations)
            mine.store = client_store(cfg, algo, mine, one, shape, C, dev)
            mine.execution = full.execution
            mine.trainer = make_trainer(cfg, algo, g.module, full.execution, self.transform, self.pad_fill,
                                        self.batch, self.extra, self.public)
            groups.append(mine)
        return ClientRuntime(
            cfg, algo, groups, {s: sp.hosting(ids) for s, sp in self.split.items()}, self.num_clients, C,
            self.batch, self.transform, self.public, dev,
            None if self.tasks is None else [st if j in ids else [] for j, st in enumerate(self.tasks)],
            None if self.exemplars is None else [{} for _ in range(self.num_clients)], self.global_test)

    def metric_sides(self) -> dict:
        """Where each metric of this run's evaluation is computed (kept in ``meta.json``): ``server`` — the global
        model on the global test set, and its continual accuracy; ``client`` — each client on its own splits, and
        its report; ``simulation`` — what needs data no deployment has in one place: the K x K cross matrix (every
        client's test split), the uploaded models' in/out-local accuracy (the clients' label histograms), personal
        models' continual accuracy (the global test set on every client)."""
        sides = {"global": "server", "global_clients": "client", "global_val": "client", "personal": "client",
                 "personal_val": "client", "report": "client", "cross": "simulation", "local_in_acc": "simulation",
                 "local_out_acc": "simulation"}
        if self.tasks is not None:
            sides["continual"] = "server" if self.algo.global_model else "simulation"
        return sides

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

    def _at_once(self, ex: Execution) -> int:
        """How many clients ``ex`` trains at once: a chunk of the cohort when mapped, one when looped."""
        return self.chunk if ex.backend == "vectorized" else 1

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
        """What the clients of the in-process runtime may train on in round ``t`` (``ClientRuntime.train_split``)."""
        return self.runtime.train_split(self.stage(t) if self.tasks is not None else None, memory)

    @property
    def exemplars(self) -> list | None:
        """Per client its exemplar memory (the in-process runtime's: with ``engine.pool: wire`` each client's is in
        its own runtime), or None."""
        return self.runtime.exemplars

    def stage(self, t: int) -> int:
        return self.calendar.stage(t)

    def task_ends(self, t: int) -> bool:
        return self.calendar is not None and self.calendar.task_ends(t)

    def first_met(self, stage: int) -> np.ndarray:
        return self.calendar.first_met(stage)

    def seen_classes(self, stage: int) -> np.ndarray:
        return self.calendar.seen_classes(stage)

    @property
    def server(self) -> dict:
        """The algorithm's server state (``ServerRuntime.state``)."""
        return self.srv.state

    @server.setter
    def server(self, state: dict) -> None:
        self.srv.state = state

    @property
    def plateau(self) -> dict:
        return self.srv.plateau

    @plateau.setter
    def plateau(self, value: dict) -> None:
        self.srv.plateau = value

    def _end_task(self, t: int) -> None:
        """The last round of a task is over: every client updates its memory and state (``ClientRuntime.end_task``)
        from the broadcast after aggregation and the model it predicts with."""
        self.pool.end_task(self.srv.header(t, 0.0), self.algo.broadcast(self.server, t), self._assign(self.everyone),
                           self.srv.global_model())

    def _assign(self, clients: np.ndarray) -> dict:
        return self.srv.assign(clients)

    @cached_property
    def everyone(self) -> np.ndarray:
        return np.arange(self.num_clients)

    # ---- one round ---------------------------------------------------------------------------------
    def cohort(self, t: int) -> np.ndarray:
        return self.srv.cohort(t)

    def round(self, t: int) -> dict:
        """Round ``t``: (round 0: every client's warm-up;) the cohort's logits on the public stream go up and the
        server's answer comes down (``Algorithm.exchanges``); the cohort trains (group by group); the server
        aggregates (and trains on the public stream: ``server_program``). Returns the round's metrics."""
        srv = self.srv
        cohort, lr = srv.cohort(t), srv.lr(t)
        header = srv.header(t, lr)
        if t == 0 and self.cfg.train.warmup_epochs:
            self.pool.warm_up(lr, srv.assign(self.everyone))
        assignment = srv.assign(cohort)
        public, shared = None, {}
        if self.algo.exchanges:  # outputs on the public stream go up first; the server's answer comes down below
            before = srv.broadcast(t, buffers=False)
            reply = self.pool.public_logits(before, assignment, t)
            shared, public = srv.exchange(reply, t), (before, reply)
        broadcast = srv.broadcast(t, shared)
        parts = self.pool.train(header, broadcast, assignment)
        cohort, up, loss, steps, weights = srv.collect(parts)
        local = self._local_in_out(cohort, up) if self.cfg.eval.local_models else {}
        srv.aggregate(t, lr, cohort, up, loss, steps, weights)
        if self.task_ends(t):
            self._end_task(t)
        return {
            **local,
            "round": t,
            "lr": lr,
            "train_loss": float(loss.mean()),
            **self._terms([p["terms"] for p in parts]),
            "clients": len(cohort),
            **({"dropped": np.setdiff1d(srv.chosen(t), cohort).tolist()} if self.cfg.participation
               and self.cfg.participation.dropout else {}),
            "local_steps_max": int(steps.max(initial=0)),
            **traffic(self.algo, len(cohort), header, broadcast, assignment, parts, public),
            **self.pool.notes(),
            **({"privacy": self._spent(t)} if self.cfg.privacy is not None else {}),
        }

    def _spent(self, t: int) -> dict:
        """Client-level DP: the (epsilon, delta) of rounds 0..t (epsilon None: no noise, no guarantee)."""
        eps = robust.epsilon(self.cfg, t + 1, self.num_clients)
        return {"epsilon": eps if np.isfinite(eps) else None, "delta": self.cfg.privacy.delta,
                "clip": self.srv.dp_clip}  # (the next round's: adaptive clipping moves it)

    @staticmethod
    def _terms(groups: list[dict]) -> dict:
        """``terms``: each named part of the local objective, its mean over the cohort of the clients' mean over
        their steps (a client whose objective has no such part, in another architecture group, does not count)."""
        names = dict.fromkeys(n for g in groups for n in g)
        if not names:
            return {}
        return {"terms": {n: float(torch.cat([g[n] for g in groups if n in g]).mean()) for n in names}}

    def _own(self, clients: np.ndarray, t: int | None = None) -> dict:
        """The per-client payload ``clients`` train with in round ``t`` (``ClientRuntime.own``)."""
        return self.runtime.own(self._assign(clients), clients, None if t is None else self.srv.header(t, 0.0))

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

    # ---- evaluation --------------------------------------------------------------------------------
    def evaluate(self, round_idx: int = 0) -> dict:
        """Metrics after round ``round_idx`` (which also seeds any fine-tuning before evaluation): the global model
        on the global test set here (server side); on the clients' splits, the personal models, the cross matrix
        and the clients' reports through the pool (``ClientRuntime.evaluate``)."""
        out: dict = {}
        ev_cfg, t = self.cfg.eval, round_idx
        gp = self.algo.global_params(self.server)
        sent = self.algo.broadcast(self.server, t)  # what the clients predict with, beside their own state
        for g in self.groups:
            g.module.eval()  # BatchNorm: use the running statistics, do not update them
        model = None if gp is None else (gp, self.groups[0].global_buffers)
        if model is not None and ev_cfg.global_test and self.global_test is not None:
            x, y = self.global_test
            ok, ls = ev.score_samples(self.groups[0].apply, {**gp, **model[1]}, x, y, self.transform,
                                      lambda z, logits: self.algo.eval_logits(z, logits, sent))
            out["global"] = ev.global_metrics(ok, ls, y, self.fd.num_classes)
        personal = ev_cfg.client_test and self.algo.personalized
        plan = None if self.tasks is None else self._continual_plan(t)
        reply = self.pool.evaluate({
            "round": t, "payload": sent, "assignment": self._assign(self.everyone), "global": model,
            "global_clients": model is not None and ev_cfg.client_test, "global_val": model is not None,
            "personal": personal, "personal_val": personal, "cross": personal and ev_cfg.cross_clients,
            "report": type(self.algo).client_report is not Algorithm.client_report,
            # personal models judge their continual rows in the same message (one message round, not two)
            **({} if plan is None or self.algo.global_model else {"continual": plan["request"]})})
        apart = np.isin(np.arange(self.num_clients), self.srv.held_out)  # (participation.held_out: never trained)
        for key, split in (("global_clients", "test"), ("global_val", "val"), ("personal", "test"),
                           ("personal_val", "val")):
            if key in reply:
                correct, sizes = reply[key].cpu().numpy(), reply["sizes"][split].cpu().numpy()
                out[key] = ev.client_summary(correct * ~apart, sizes * ~apart)
                if apart.any():
                    out.setdefault("held_out", {})[key] = ev.client_summary(correct * apart, sizes * apart)
        if "cross" in reply and int(reply["sizes"]["test"].sum()):
            out["cross"] = ev.cross_summary(reply["cross"].cpu().numpy(), reply["sizes"]["test"].cpu().numpy())
            names = self.fd.dataset.group_names
            if self.cfg.data.partition.get("scheme") in ("natural", "domains") and names \
                    and len(names) == self.num_clients:
                out["cross"]["names"] = list(names)  # one client per group: name the rows by the domain
        if plan is not None:
            out["continual"] = self._continual(t, plan, reply.get("continual"))
        report = self.algo.report(self.server, reply["report"]["reports"] if "report" in reply else {})
        if report:
            out["report"] = report
        notes = self.pool.notes()  # a deployment: who answered the evaluation
        if notes:
            out["deploy_eval"] = notes["deploy"]
        return out

    def _continual_plan(self, t: int) -> dict:
        """The samples each model judges in :meth:`_continual` after round ``t``, and the request of the personal
        models' part (``continual``: rows by client, in (architecture, id) order)."""
        stage = self.stage(t)
        first = self.first_met(stage)
        unseen = torch.as_tensor(first > stage, device=self.device)
        order = np.concatenate([g.clients for g in self.groups])  # the personal models, (architecture, id) order
        n = 1 if self.algo.global_model else len(order)
        seen = np.flatnonzero(first[self.global_labels] <= stage)
        rows = ev.deal(self.global_labels, self._test_ranks, seen, n, self.cfg.eval.continual_sample)
        return {"stage": stage, "first": first, "unseen": unseen, "seen": seen, "rows": rows, "n": n,
                "request": {"ids": torch.as_tensor(order), "rows": torch.as_tensor(rows), "unseen": unseen}}

    def _continual(self, t: int, plan: dict | None = None, hits: torch.Tensor | None = None) -> dict:
        """Class-incremental accuracy after round ``t``: the model(s) clients predict with — the global one, or each
        client's own (then the mean over clients) — on the global test samples of every class met so far, choosing
        among those classes only (no task id). ``tasks[j]``: on the classes first met in stage j (the accuracy
        matrix's row; for a shared task order, task j's classes).

        An evaluation makes at most ``eval.continual_sample`` predictions, so its cost stays flat as classes
        accumulate: beyond it each model judges its share of a fixed class-stratified order of the seen samples
        (``evaluate.deal``; recorded as ``sample``). Each class's accuracy over its judged samples then counts by
        the class's test size, as in the full evaluation, which it equals when every model judges every sample.
        A global model is judged here; personal models by their clients (``ClientRuntime.evaluate``), each on the
        rows dealt to it (``hits``: their answers to ``plan["request"]``, asked here when not given)."""
        plan = plan or self._continual_plan(t)
        stage, first, rows, seen, n = plan["stage"], plan["first"], plan["rows"], plan["seen"], plan["n"]
        labels, C = self.global_labels, self.fd.num_classes
        if self.algo.global_model:
            x, y = self.global_test
            sent, g = self.algo.broadcast(self.server, t), self.groups[0]
            g.module.eval()
            params, bufs = self._predictors(g, t, 1)
            masked = lambda z, logits: self.algo.eval_logits(z, logits, sent).masked_fill(plan["unseen"],  # noqa
                                                                                          float("-inf"))
            hits = ev.judged_correct(g.apply, {**params, **bufs}, x, y, torch.as_tensor(rows, device=self.device),
                                     self.transform, g.trainer.vectorize, masked)
        elif hits is None:
            hits = self.pool.evaluate({"round": t, "payload": self.algo.broadcast(self.server, t),
                                       "assignment": self._assign(self.everyone),
                                       "continual": plan["request"]})["continual"]
        hits = hits.cpu().numpy()
        acc = ev.judged_class_accuracy(rows, hits, labels, C)
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
        return ev.class_ranks(self.global_labels, data_spec(self.cfg).seed)

    def _predictors(self, g: Group, t: int, n: int | None = None) -> tuple[dict, dict]:
        """(parameters, buffers) of the model each client of ``g`` predicts with (``ClientRuntime.predictors``)."""
        return self.runtime.predictors(g, t, self.algo.broadcast(self.server, t), self._assign(g.clients),
                                       self.srv.global_model(), n)

    def _personal(self, g: Group, t: int) -> dict:
        """Every client's personal model in group ``g`` (``ClientRuntime.personal``)."""
        return self.runtime.personal(g, t, self.algo.broadcast(self.server, t), self._assign(g.clients))

    # ---- checkpoints -------------------------------------------------------------------------------
    #: The checkpoint layout: 2 = the server's part and the clients' parts keyed by client id (format 1, before the
    #: server/client split: per architecture group its store and a (buffers, server buffers, task buffers) triple).
    FORMAT = 2

    def state_dict(self) -> dict:
        """A checkpoint: the server's part (its state, BatchNorm statistics and learning-rate plateau) and the
        clients' (collected from the pool) — per architecture its clients' ``ids`` and their store and buffers
        stacked in that order, and per client id its exemplar memory. Which pool wrote it, and how it sharded the
        clients, leaves no trace: any pool resumes it."""
        if getattr(self.pool, "remote", False):  # the clients' state stays on their nodes: the pool's record of it
            return {"format": self.FORMAT, "server": self.server,
                    "server_buffers": [g.global_buffers for g in self.groups], "plateau": dict(self.plateau),
                    "server_opt": self.srv.opt_state, "dp_clip": self.srv.dp_clip, "clients": self.pool.state(),
                    "memory": None}
        parts = self.pool.state()
        clients, memory = [], [None] * self.num_clients
        for g in self.groups:
            (mine,) = order_parts([p for part in parts for p in part["groups"] if p["arch"] == g.gid])
            clients.append(mine)
        for part in parts:
            for k, m in zip(np.concatenate([ids_of(p) for p in part["groups"]]), part["memory"] or []):
                memory[k] = m
        return {"format": self.FORMAT, "server": self.server, "server_buffers": [g.global_buffers for g in self.groups],
                "plateau": dict(self.plateau), "server_opt": self.srv.opt_state, "dp_clip": self.srv.dp_clip,
                "clients": clients,
                "memory": None if self.exemplars is None else memory}

    def upgrade(self, state: dict) -> dict:
        """A checkpoint in today's layout: format 2 as it is; format 1 (no ``format``: written before the
        server/client split) converted, its groups' clients being this run's. Anything else: ValueError."""
        fmt = state.get("format", 1)
        if fmt == self.FORMAT:
            return state
        if fmt != 1 or "stores" not in state:
            raise ValueError(f"checkpoint format {fmt}; this fedmosaic reads formats 1 and {self.FORMAT}")
        # Checkpoints written before BatchNorm support carry no "buffers"; that is only equivalent when the model
        # has none.
        buffers = state.get("buffers")
        if buffers is None:
            if any(g.buffers or g.global_buffers for g in self.groups):
                raise CorruptDataError("checkpoint has no BatchNorm statistics but the model has buffers; "
                                       "it was written for a different model")
            buffers = [({}, {}, {})] * len(self.groups)
        if len(state["stores"]) != len(self.groups) or len(buffers) != len(self.groups):
            raise ValueError("written for another number of architectures")
        if any(not tb and b for b, _, *tb in buffers):  # written before teachers had statistics of their own
            raise CorruptDataError("checkpoint has no teacher BatchNorm statistics; it was written by an older "
                                   "fedmosaic")
        clients = [{"arch": g.gid, "ids": torch.as_tensor(g.clients), "store": s, "buffers": b,
                    "task_buffers": tb[0] if tb else {}}
                   for g, s, (b, _, *tb) in zip(self.groups, state["stores"], buffers, strict=True)]
        old = {k: v for k, v in state.items() if k not in ("stores", "buffers")}
        return {**old, "format": self.FORMAT, "server_buffers": [gb for _, gb, *_ in buffers], "clients": clients}

    def load_state_dict(self, state: dict) -> None:
        """Resume from a checkpoint of either format, into whichever pool this run has."""
        state = self.upgrade(state)
        if getattr(self.pool, "remote", False):
            self.pool.load(state["clients"])
            self.server, self.plateau = state["server"], dict(state.get("plateau", self.plateau))
            self.srv.opt_state, self.srv.dp_clip = state.get("server_opt"), state.get("dp_clip")
            for g, gb in zip(self.groups, state["server_buffers"], strict=True):
                g.global_buffers = gb
            return
        if self.exemplars is not None and (state.get("memory") is None or len(state["memory"]) != self.num_clients):
            raise ValueError("written without this run's exemplar memory")  # (before anything is replaced)
        clients = state["clients"]
        if len(clients) != len(self.groups) or any(
                c["arch"] != g.gid or not np.array_equal(ids_of(c), g.clients)
                for c, g in zip(clients, self.groups, strict=False)):
            raise ValueError("written for another assignment of clients to architectures")
        self.server = state["server"]
        self.plateau = dict(state.get("plateau", self.plateau))
        self.srv.opt_state, self.srv.dp_clip = state.get("server_opt"), state.get("dp_clip")
        for g, gb in zip(self.groups, state["server_buffers"], strict=True):
            g.global_buffers = gb
        self.pool.load([self._client_part(h, clients, state.get("memory")) for h in self.pool.hosted()])

    def _client_part(self, hosted: Hosted, clients: list[dict], memory: list | None) -> dict:
        """A runtime's rows of a checkpoint's client parts (the same tensors when it hosts every client)."""
        groups = []
        for gid, ids in hosted.groups:
            full = clients[self.srv.group_index[gid]]
            trees = [full[k] for k in ("store", "buffers", "task_buffers")]
            if not np.array_equal(ids_of(full), ids):
                at = torch.as_tensor(np.searchsorted(ids_of(full), ids))
                trees = [take(tr, at) for tr in trees]
            store, bufs, task = trees
            groups.append({"arch": gid, "ids": torch.as_tensor(ids), "store": store, "buffers": bufs,
                           "task_buffers": task})
        return {"groups": groups, "memory": [memory[k] for k in hosted.clients] if hosted.memory else None}
