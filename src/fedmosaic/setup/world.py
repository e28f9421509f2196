"""A run built once from its config and its data (``World``), and the driver made from it (:func:`build_federation`):
device and precision policy, the partition on the device and its normalisation, the architecture groups and how each
executes, the task calendar and exemplar memory, the public stream, the algorithm, the server runtime and the
in-process client runtime, and every preflight check that can refuse a run before its first round. Nothing below
this layer reads the whole config: this is where a run's configuration becomes values (the runtimes get
``engine.settings.RoundSettings``)."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace
from functools import partial

import numpy as np
import torch

from ..config import RunConfig, trainable
from ..data.federated import FederatedData
from ..data.federated import build as lay_out
from ..data.partition.tasks import task_streams
from ..engine import evaluate as ev
from ..engine import robust
from ..engine.client.augment import black
from ..engine.client.compiled import CompileCache
from ..engine.client.execution import Execution, ModelFacts, RunFacts, choose, step_profile
from ..engine.client.runtime import ClientRuntime, Hosted
from ..engine.client.threads import cpu_threads
from ..engine.client.transforms import make_normalizer
from ..engine.federation import Federation
from ..engine.group import Group
from ..engine.pools.local import InProcessPool
from ..engine.pools.wire import WirePool
from ..engine.seeding import POOL, TASKS, held_out, rng
from ..engine.server.calendar import TaskCalendar
from ..engine.server.runtime import ServerRuntime
from ..engine.settings import RoundSettings
from ..engine.tensors import ClientTensors
from ..errors import ConfigError
from ..models import head_keys, norm_keys
from ..protocol.algorithm import registered
from ..protocol.program import Setting
from ..protocol.tree import nbytes
from .groups import (
    build_extra,
    build_groups,
    build_public,
    check_models_fit,
    client_store,
    compile_key,
    data_spec,
    make_trainer,
)
from .preflight import (
    activation_bytes,
    check_evaluation,
    check_memory_total,
    check_plans,
    check_precision,
    check_slots,
    check_training_memory,
    denormals,
    memory_bytes,
    precision,
    resolve_device,
)

POOLS = ("local", "wire", "ray", "none")


def build_federation(cfg: RunConfig, fd: FederatedData | None = None, threads: int | None = None,
                     pool=None, warm: tuple[bool, ...] | None = None) -> Federation:
    """The run ``cfg`` ready for its first round: its world, the server runtime, the clients in a pool, and the
    driver of rounds over them. ``threads``: the CPU threads a resumed run started with (``threads.cpu_threads``).
    ``pool`` (default ``engine.pool``): ``local``, every client in this process's one runtime; ``wire``, each client
    in a runtime of its own, every message through the codec (``pools.wire.WirePool``); ``ray``, shards of clients on
    Ray actors (``pools.ray.RayPool``); ``none``, no clients here (a process that hosts some itself:
    :meth:`World.client_runtime` — a Ray actor, a Flower node); or a function of the federation that makes the pool
    (a deployment's: ``deploy.server.FlowerPool``, whose clients keep their state on their nodes: ``pool.remote``).
    Only the local pool's clients have their state in this process. ``warm``: per architecture whether ``compile:
    auto`` counts on the compile cache's short warm-up — what a resumed run started with (``meta.json``); None:
    what the cache holds now (a process without clients of its own, a deployed node, counts on the cold one)."""
    pool = cfg.engine.pool if pool is None else pool
    if pool not in POOLS and not callable(pool):
        raise ValueError(f"pool: 'local', 'wire', 'ray' or 'none' (got {pool!r})")
    if warm is None and pool == "none":
        warm = ()  # (every architecture: the cold warm-up)
    world = World(cfg, fd, threads, local=pool == "local", warm=warm)
    if pool != "local" and cfg.eval.cross_clients:
        raise ConfigError("eval.cross_clients: the K x K matrix needs every client's test split in one process; "
                          "it is measured with engine.pool: local only")
    fed = Federation(world, world.srv, world.runtime, None)
    if pool == "ray":
        fed.pool = ray_pool(cfg, fed)
    else:
        fed.pool = (InProcessPool(world.runtime) if pool == "local" else world.wire_pool() if pool == "wire"
                    else None if pool == "none" else pool(fed))
    return fed


def ray_pool(cfg: RunConfig, fed: Federation):
    """``engine.pool: ray``: the federation's clients on Ray actors built from ``cfg``, with the models and public
    dataset this process registered that the run uses (``plugins``)."""
    from .. import models as zoo
    from .. import plugins
    from ..data import registry
    from ..engine.pools.ray import RayPool

    o = cfg.engine.ray
    used = [cfg.model.name, *(a.name for a in cfg.model.heterogeneous or [])]
    public = [] if cfg.data.public is None else [cfg.data.public.source.lower()]
    mine = lambda kind, names: [n for n in names if (kind, n) in plugins.ORIGINS]  # noqa: E731
    registered = {"models": {n: (zoo.MODELS[n], zoo.HEADS.get(n)) for n in mine("model", used)},
                  "datasets": {n: registry.REGISTRY[n] for n in mine("dataset", public)}}
    warm = tuple(g.execution.warm for g in fed.groups)  # (the actors decide as the driver did)
    threads = cfg.engine.threads or max(1, math.ceil(o.cpus_per_actor))
    return RayPool(fed, partial(remote_runtime, cfg, warm=warm), o, threads,
                   None if cfg.engine.memory_mb is None else cfg.engine.memory_mb * 2**20, registered)


def remote_runtime(cfg: RunConfig, fd: FederatedData, shard, threads: int,
                   warm: tuple[bool, ...]) -> ClientRuntime:
    """The runtime of the clients ``shard`` in a process of their own (a Ray actor), built from the run's config and
    partition as the driver built its own (``warm``: the driver's)."""
    return World(cfg, fd, threads, local=False, warm=warm).client_runtime(shard)


class World:
    """Everything a run is built from, computed once from its config and its data, with the server runtime (``srv``)
    and the runtime of every client hosted in this process (``runtime``) it builds (see the module's docstring)."""

    def __init__(self, cfg: RunConfig, fd: FederatedData | None = None, threads: int | None = None,
                 local: bool = True, warm: tuple[bool, ...] | None = None):
        """``local``: every client's state in this process (the local pool); else each runtime builds its own.
        ``warm``: as :func:`build_federation`'s."""
        self.cfg, self._warm = cfg, warm
        denormals(cfg.engine.denormals)  # first: before torch starts its threads, which inherit the flags
        #: what the runtimes read of the config (``engine.settings``): they never see ``cfg`` itself
        self.settings = settings = RoundSettings(
            cfg.seed, cfg.algorithm.name, cfg.train, cfg.eval, cfg.participation, cfg.attack, cfg.aggregation,
            cfg.privacy, cfg.exemplar_memory(), cfg.data.partition.get("scheme") in ("natural", "domains"))
        #: torch's CPU threads for the whole run: never more than the cores free for it (``threads.cpu_threads``)
        self.threads = cpu_threads(cfg.engine.threads, threads)
        torch.set_num_threads(self.threads.count)
        self.device = dev = resolve_device(cfg.engine.device)  # before any data is read
        precision(cfg.engine.deterministic, cfg.engine.tf32, dev)
        check_precision(cfg.engine.precision, dev)
        # before any data are read
        robust.check(settings, registered()[cfg.algorithm.name], cfg.data.tasks is not None,
                     min(cfg.train.clients_per_round, trainable(cfg)))
        budget = lambda: memory_bytes(dev) if cfg.engine.memory_mb is None else cfg.engine.memory_mb * 2**20  # noqa
        if fd is None:  # a model that cannot fit is refused before the data are laid out (a copy of the dataset)
            spec = data_spec(cfg)
            spec.canonical()  # a bad partition is named before any data are read
            ds = spec.load()
            check_models_fit(cfg, ds.input_shape, ds.num_classes, budget(), dev, None)
            fd = lay_out(spec, ds)
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
        self.split["train"] = robust.flip_labels(settings, self.split["train"], self.fd.num_classes)
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
        if cfg.privacy is not None and any(v.is_floating_point() for g in self.groups
                                           for v in g.global_buffers.values()):
            raise ConfigError(f"privacy: model {cfg.model.name!r} keeps BatchNorm running statistics, computed from "
                              "each client's data and averaged neither clipped nor noised, so the reported epsilon "
                              "would not hold for them; choose a model without BatchNorm (model option norm: none for "
                              "the CNNs, norm: group for the ResNets and MobileNets)")
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
        #: per global test sample its rank in its class (``evaluate.class_ranks``): fixed by the data seed, so a sampled
        #: continual evaluation judges the same samples for every method and evaluation
        self.test_ranks = None if self.tasks is None else ev.class_ranks(self.global_labels, data_spec(cfg).seed)
        #: what the server knows of the task streams (``calendar.TaskCalendar``); None without ``data.tasks``
        self.calendar = None if self.tasks is None else TaskCalendar(
            [[task and task[:2] for task in st] for st in self.tasks], cfg.data.tasks.rounds_per_task,
            self.fd.num_classes)
        # per client its exemplar memory (``data.tasks.memory``): class -> offsets into its train rows, best first
        exemplars = [{} for _ in range(self.num_clients)] if self.tasks and cfg.exemplar_memory() else None
        pc, tc = cfg.train.optimizer.plateau, cfg.data.tasks
        if pc is not None and tc is not None and tc.rounds_per_task - pc.skip - 1 <= pc.patience:
            warnings.warn(f"train.optimizer.plateau: a task of {tc.rounds_per_task} rounds compares "
                          f"{max(0, tc.rounds_per_task - pc.skip)} losses (skip {pc.skip}), too few to exceed patience "
                          f"{pc.patience}: the learning rate is never reduced", stacklevel=3)
        self.extra = build_extra(cfg, algo_cls.extra_models(algo_cfg, cfg.model), len(self.groups),
                                 self.fd.dataset.input_shape, self.fd.num_classes, self.num_clients, self.memory, dev)
        part = cfg.participation
        never_train = held_out(self.num_clients, part.held_out if part else 0.0, cfg.seed)  # participation
        setting = Setting(self.fd.num_classes, dims.pop() if len(dims) == 1 else 0, self.fd.num_clients,
                          cfg.train.optimizer,
                          cfg.train.local_epochs, self.batch, head_keys(self.groups[0].module),
                          {s: {k: v.detach().clone() for k, v in m.named_parameters()} for s, m in self.extra.items()},
                          cfg.train.rounds, tc.rounds_per_task if tc else 0, tc.n_tasks if tc else 0,
                          self.groups[0].init, norm_keys(self.groups[0].module),
                          self.num_clients - len(never_train))
        self.algo = algo_cls(algo_cfg, setting)
        if self.algo.pooled:
            self._pool_train_split()
        #: the server side of every round (``server.runtime.ServerRuntime``)
        self.srv = ServerRuntime(settings, self.algo, self.groups, self.num_clients, self.calendar, self.public,
                                 self.transform, self.batch, dev, never_train)
        # the batch plans are drawn on the host, then copied to the device: both must hold them
        for memory, where in [(self.memory, dev)] + ([] if dev.type == "cpu" else
                                                     [(memory_bytes(torch.device("cpu")), torch.device("cpu"))]):
            check_plans(cfg, self.algo, self.srv.state, self.num_clients, self.chunk, self.batch,
                        int(self.split["train"].sizes.max(initial=1)),
                        None if self.public is None else len(self.public.y), memory, where)
        shape, C = self.fd.dataset.input_shape, self.fd.num_classes
        #: every client, hosted in this process (its groups' stores and trainers are set up below)
        self.runtime = ClientRuntime(settings, self.algo, self.groups, self.split, self.num_clients, C, self.batch,
                                     self.transform, self.public, dev, self.tasks, exemplars, self.global_test)
        for g in self.groups:
            one = self.algo.init_client(g.init)
            g.execution = ex = self._choose_execution(g)
            g.activations = activation_bytes(g.module, shape, self.batch)
            if local:  # every client's state in this process; another pool's runtimes hold their own
                check_training_memory(g.module, g.init, len(g.clients), nbytes(one), self._at_once(ex),
                                      self.memory, dev, g.activations)
                g.store = client_store(cfg, self.algo, g, one, shape, C, dev)
            # running statistics are updated in place during the forward pass, which vmap cannot do per client:
            # such groups take the sequential path (same results, no vmap)
            if g.global_buffers and cfg.engine.backend != "sequential":
                warnings.warn(f"model {g.module.__class__.__name__} has buffers (BatchNorm running statistics or "
                              "others): its clients train on the sequential path", stacklevel=3)
            g.trainer = make_trainer(cfg, self.algo, g.module, ex, self.transform, self.pad_fill, self.batch,
                                     self.extra, self.public, g.compile_key)
            check_slots(self.algo, self.srv.state, one, g.clients[:1])

    def wire_pool(self, shards: list | None = None) -> WirePool:
        """One runtime per client (or per shard of client ids): :meth:`client_runtime`."""
        shards = [np.sort(np.asarray(s, dtype=np.int64)) for s in
                  (shards if shards is not None else [[k] for k in range(self.num_clients)])]
        hosted = [Hosted(tuple((g.gid, mine) for g, mine in self.runtime.by_group(ids)),
                         self.runtime.exemplars is not None) for ids in shards]
        # built at once: the runtimes of a round's cohort (each of its messages reaches them all)
        return WirePool(self.client_runtime, shards, hosted, self.algo, self.device, self.cfg.train.clients_per_round)

    def client_runtime(self, shard) -> ClientRuntime:
        """A runtime of the clients ``shard``, built as a device would build it: its own modules (from the run's
        seeds), its own store and trainer (run as this process's architecture groups are), and its own rows of the
        data — what a wire pool's runtime, or a deployed node, hosts."""
        cfg, shape, C, dev = self.cfg, self.fd.dataset.input_shape, self.fd.num_classes, self.device
        ids, algo = np.sort(np.asarray(shard, dtype=np.int64)), type(self.algo)(self.algo.cfg, self.algo.setting)
        fresh = build_groups(cfg, shape, C, self.num_clients, self.memory, dev)
        groups = []
        mine_of = {g.gid: mine for g, mine in self.runtime.by_group(ids)}
        for g, full in zip(fresh, self.groups, strict=True):
            if full.gid not in mine_of:
                continue
            mine = Group(g.gid, g.module, mine_of[full.gid])
            one = algo.init_client(mine.init)
            check_training_memory(g.module, mine.init, len(mine.clients), nbytes(one),
                                  min(self._at_once(full.execution), len(mine.clients)), self.memory, dev,
                                  full.activations)
            mine.store = client_store(cfg, algo, mine, one, shape, C, dev)
            mine.execution = full.execution
            mine.trainer = make_trainer(cfg, algo, g.module, full.execution, self.transform, self.pad_fill,
                                        self.batch, self.extra, self.public, full.compile_key)
            groups.append(mine)
        return ClientRuntime(
            self.settings, algo, groups, {s: sp.hosting(ids) for s, sp in self.split.items()}, self.num_clients, C,
            self.batch, self.transform, self.public, dev,
            None if self.tasks is None else [st if j in ids else [] for j, st in enumerate(self.tasks)],
            None if self.runtime.exemplars is None else [{} for _ in range(self.num_clients)], self.global_test)

    def run_facts(self, g: Group, sample: int = 32) -> RunFacts:
        """The run's step profile for group ``g`` (``execution.RunFacts``), from up to ``sample`` of its cohorts
        (spread over the run) and the round program of the first round."""
        tc = self.cfg.train
        picks = np.unique(np.linspace(0, tc.rounds - 1, min(tc.rounds, sample)).astype(np.int64))
        cohorts = [c[self.runtime.group_of[c] == g.gid] for c in (self.srv.cohort(int(t)) for t in picks)]
        sizes = self.split["train"].sizes
        program = self.algo.program(0)
        active, updates = np.zeros(0), 0.0
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
            updates += prof.sum() * len(ph.updates)
        return RunFacts(tc.rounds, tuple(active.tolist()), all(ph.plain for ph in program), self.batch,
                        updates / max(active.sum(), 1))

    def _at_once(self, ex: Execution) -> int:
        """How many clients ``ex`` trains at once: a chunk of the cohort when mapped, one when looped."""
        return self.chunk if ex.backend == "vectorized" else 1

    def _choose_execution(self, g: Group) -> Execution:
        e = self.cfg.engine
        g.compile_key = compile_key(self.cfg, g.module, self.fd.dataset.input_shape, self.batch, self.device)
        # fp16 checks each step's gradients for overflow (``Objective._scaled``): its steps are never fused
        fuse = 1 if e.precision == "fp16" else e.fuse_steps
        return replace(choose(e.backend, e.compile, fuse, ModelFacts.of(g.module), self.device.type,
                              self.run_facts(g), threads=e.threads,
                              warm=CompileCache.default().warm(g.compile_key) if self._warm is None
                              else g.gid < len(self._warm) and self._warm[g.gid]),
                       cpu_threads=self.threads)

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
        order it meets them — ``random``: the client's own; one ``shared`` order: stage j is task j for every client,
        and a client that holds no sample of task j (or was not dealt it, ``tasks_per_client``) has None there and
        sits the stage out, so the federation meets the tasks in that order (stage j's classes are task j's)."""
        tc = cfg.data.tasks
        if tc is None:
            return None
        if self.global_test is None:
            raise ConfigError("data.tasks: class-incremental accuracy is measured on the dataset's test split, which "
                              "this data setting pools away; use data.pool: train")
        ptr = self.split["train"].ptr
        parts = [np.arange(ptr[k], ptr[k + 1]) for k in range(self.num_clients)]
        # (drawn from the data seed, as the partition: data.seed keeps the whole data setting across run seeds)
        streams = task_streams(self.fd.y["train"], parts, tc.n_tasks, tc.tasks_per_client,
                               rng(data_spec(cfg).seed, TASKS), tc.classes_per_task)
        if tc.order == "shared":
            streams = [[{task[0]: task for task in st}.get(j) for j in range(1 + max(t for t, _, _ in st))]
                       if st else [] for st in streams]
        longest = max(map(len, streams))
        empty = [j for j in range(longest) if all(j >= len(st) or st[j] is None for st in streams)]
        if empty and cfg.train.rounds > empty[0] * tc.rounds_per_task:
            raise ConfigError(f"data.tasks: no client holds a sample of task {empty[0]} (shared order): its stage "
                              "would have nobody to train; use order: random, fewer tasks or more clients")
        if cfg.train.rounds > longest * tc.rounds_per_task:
            raise ConfigError(f"train.rounds: the longest client task stream ({longest} tasks of {tc.rounds_per_task} "
                              f"rounds) ends after round {longest * tc.rounds_per_task} (got {cfg.train.rounds})")
        mc = cfg.exemplar_memory()
        if mc is not None and mc.total is not None:
            check_memory_total(mc.total, "data.tasks.memory.total" if mc is tc.memory
                                     else f"algorithm.memory.total of {cfg.algorithm.name}",
                                     max(len(task[1]) for st in streams for task in st if task), longest)
        return [[task and (task[0], task[1], task[2] - ptr[k]) for task in st] for k, st in enumerate(streams)]
