"""The in-process driver of a built run (``setup.world.build_federation``): ``Federation.round(t)`` carries one
communication round's messages between the server runtime (``server.runtime.ServerRuntime``) and the client runtimes
of a pool (``pools``); ``evaluate(t)`` measures it (``evaluation``). Rounds, checkpoints and files are the run
layer's business (``runs``), the checkpoint format this package's (``state``)."""

from __future__ import annotations

from functools import cached_property

import numpy as np
import torch

from . import accounting, evaluation, state
from . import evaluate as ev
from .group import Group
from .messages import traffic
from .tensors import ClientTensors


class Federation:
    """A run in one process, driven round by round as messages between the server side (``srv``: server state,
    BatchNorm statistics, schedule, cohorts, exchange, aggregation) and the clients in a pool (``pool``: client
    runtimes). Neither side touches the other's state; this class only carries the messages and keeps the
    simulation's view (the global test set, the clients' label histograms for in/out-local accuracy). What the run
    was built from — config, data, groups, algorithm, calendar — is its ``world``'s (``setup.world.World``), read
    through as attributes of the federation."""

    def __init__(self, world, srv, runtime, pool):
        """``runtime``: every client, hosted in this process (the local pool's; others host their own)."""
        self.world, self.srv, self.runtime, self.pool = world, srv, runtime, pool
        #: per client its architecture and its row in that group's store
        self.group_of, self.row_of = runtime.group_of, runtime.row_of

    def __getattr__(self, name: str):
        if name == "world":  # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self.world, name)

    @property
    def execution(self) -> str:
        """How the run executes, in words (one group; several: each named), and on how many CPU threads."""
        described = [g.execution.describe() for g in self.groups]
        text = described[0] if len(set(described)) == 1 else "; ".join(
            f"{g.module.__class__.__name__}: {d}" for g, d in zip(self.groups, described, strict=True))
        return f"{text}; {self.threads}"

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
        self.pool.end_task(self.srv.header(t, 0.0), self.algo.broadcast(self.server, t), self.assign(self.everyone),
                           self.srv.global_model())

    def assign(self, clients: np.ndarray) -> dict:
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
        if t == 0 and self.settings.train.warmup_epochs:
            self.pool.warm_up(lr, srv.assign(self.everyone))
        assignment = srv.assign(cohort)
        public, shared = None, {}
        if self.algo.exchanges:  # outputs on the public stream go up first; the server's answer comes down below
            before = srv.broadcast(t, buffers=False)
            reply = self.pool.public_logits(before, assignment, t)
            shared, public = srv.exchange(reply, t), (before, reply)
        broadcast = srv.broadcast(t, shared)
        parts = self.pool.train(header, broadcast, assignment)
        cohort, up, loss, steps, weights, stats = srv.collect(parts)
        srv.aggregate(t, lr, cohort, up, loss, steps, weights, stats)
        local = self._local_in_out(cohort, up) if self.settings.eval.local_models else {}  # (the new statistics)
        if self.task_ends(t):
            self._end_task(t)
        return {
            **local,
            "round": t,
            "lr": lr,
            "train_loss": float(loss.mean()),
            **self._terms([p["terms"] for p in parts]),
            "clients": len(cohort),
            "cohort": np.asarray(cohort).tolist(),  # (who trained: comparisons can show they shared every cohort)
            **({"dropped": np.setdiff1d(srv.chosen(t), cohort).tolist()} if self.settings.participation
               and self.settings.participation.dropout else {}),
            "local_steps_max": int(steps.max(initial=0)),
            **traffic(self.algo, len(cohort), header, broadcast, assignment, parts, public),
            **self.pool.notes(),
            **({"privacy": self._spent(t)} if self.settings.privacy is not None else {}),
        }

    def _spent(self, t: int) -> dict:
        """Client-level DP: the (epsilon, delta) of rounds 0..t (epsilon None: no noise, no guarantee)."""
        eps = accounting.epsilon(self.settings, self.srv.populations(t + 1))
        return {"epsilon": eps if np.isfinite(eps) else None, "delta": self.settings.privacy.delta,
                "clip": self.srv.dp_clip}  # (the next round's: adaptive clipping moves it)

    @staticmethod
    def _terms(groups: list[dict]) -> dict:
        """``terms``: each named part of the local objective, its mean over the cohort of the clients' mean over
        their steps (a client whose objective has no such part, in another architecture group, does not count)."""
        names = dict.fromkeys(n for g in groups for n in g)
        if not names:
            return {}
        return {"terms": {n: float(torch.cat([g[n] for g in groups if n in g]).mean()) for n in names}}

    def own(self, clients: np.ndarray, t: int | None = None) -> dict:
        """The per-client payload ``clients`` train with in round ``t`` (``ClientRuntime.own``)."""
        return self.runtime.own(self.assign(clients), clients, None if t is None else self.srv.header(t, 0.0))

    def _local_in_out(self, cohort: np.ndarray, uploads: dict) -> dict:
        """In-local / out-local accuracy of the cohort's freshly trained models (global-model algorithms)."""
        if self.global_test is None or "model" not in uploads or not self.algo.global_model:
            return {}
        g = self.groups[0]
        g.module.eval()
        x, y = self.global_test
        transform, batch = g.trainer.judging
        acc = ev.local_class_accuracy(g.apply, {**uploads["model"], **g.global_buffers_like(len(cohort))}, x, y,
                                      self.fd.num_classes, transform, g.trainer.vectorize, batch)
        in_acc, out_acc = ev.in_out_local(acc, self.label_counts[cohort])
        return {"local_in_acc": in_acc, "local_out_acc": out_acc}

    def predictors(self, g: Group, t: int, n: int | None = None) -> tuple[dict, dict]:
        """(parameters, buffers) of the model each client of ``g`` predicts with (``ClientRuntime.predictors``)."""
        return self.runtime.predictors(g, t, self.algo.broadcast(self.server, t), self.assign(g.clients),
                                       self.srv.global_model(), n)

    def personal(self, g: Group, t: int) -> dict:
        """Every client's personal model in group ``g`` (``ClientRuntime.personal``)."""
        return self.runtime.personal(g, t, self.algo.broadcast(self.server, t), self.assign(g.clients))

    # ---- evaluation and checkpoints (``evaluation``, ``state``) -------------------------------------------------
    def evaluate(self, round_idx: int = 0) -> dict:
        return evaluation.evaluate(self, round_idx)

    def report(self, round_idx: int) -> dict:
        return evaluation.report(self, round_idx)

    def metric_sides(self) -> dict:
        return evaluation.metric_sides(self)

    def _continual(self, t: int, plan: dict | None = None, hits: torch.Tensor | None = None) -> dict:
        return evaluation.continual(self, t, plan, hits)

    def state_dict(self) -> dict:
        return state.state_dict(self)

    def upgrade(self, checkpoint: dict) -> dict:
        return state.upgrade(self, checkpoint)

    def load_state_dict(self, checkpoint: dict) -> None:
        state.load_state_dict(self, checkpoint)
