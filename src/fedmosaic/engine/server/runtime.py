"""The server side of a round: the algorithm's server state, the global model's BatchNorm statistics, the learning
rate and its plateau schedule, the cohorts, and what the server makes of the clients' answers — the exchange,
aggregation and its own training on the public stream.

It reads only messages from the clients (uploads, logits) and never their data or store; what it knows of the
federation is the number of clients, their architectures and the task calendar.
"""

from __future__ import annotations

import warnings
from itertools import zip_longest
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils._pytree import tree_structure

from ...errors import ConfigError
from ...protocol.algorithm import Algorithm
from ...protocol.program import Signals
from ...protocol.tree import all_finite, layout, leaves, tmap, weighted_mean
from .. import robust
from ..group import Group
from ..messages import ids_of
from ..seeding import drop_out, sample_cohort
from ..tensors import ClientTensors, cat_trees
from .calendar import TaskCalendar

if TYPE_CHECKING:
    from ..settings import RoundSettings


def average_buffers(stacked: dict, weights: torch.Tensor, counts: str = "max") -> dict:
    """Weighted mean of float buffers (running mean/var; a variance never below 0, which no honest client sends
    and BatchNorm would take the root of); integer counters take the largest value (``counts`` "median": the
    median, so that no one client sets them)."""
    def one(k: str, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t.median(0).values if counts == "median" else t.max(0).values
        mean = weighted_mean({k: t}, weights)[k]
        return mean.clamp(min=0) if k.endswith("running_var") else mean
    return {k: one(k, t) for k, t in stacked.items()}


_STAT = "\0buffer/"  # a BatchNorm statistic's key beside the parameters the robust stage sees (no parameter's name)


class ServerRuntime:
    """``groups``: the run's architectures (their initial parameters, modules and trainers, and the server's copy
    of their BatchNorm statistics, ``global_buffers``); ``calendar``: the task streams as the server knows them (or
    None); ``public``/``transform``/``batch``: the public stream the server trains on (``server_program``)."""

    def __init__(self, settings: RoundSettings, algo: Algorithm, groups: list[Group], num_clients: int,
                 calendar: TaskCalendar | None, public: ClientTensors | None, transform, batch: int,
                 device: torch.device, held_out: np.ndarray):
        self.settings, self.algo, self.groups, self.num_clients = settings, algo, groups, num_clients
        self.calendar, self.public, self.transform, self.batch, self.device = calendar, public, transform, batch, device
        self.group_index = {g.gid: i for i, g in enumerate(groups)}
        self.state = algo.init_server([g.init for g in groups])
        #: ``train.optimizer.plateau``: the learning rate's scale, the best mean loss so far, rounds without progress
        self.plateau = {"scale": 1.0, "best": float("inf"), "bad": 0}
        #: ``aggregation.optimizer``: the server optimizer's moments (None before its first step)
        self.opt_state: dict | None = None
        #: ``privacy``: the clip of the next round (adaptive clipping moves it)
        self.dp_clip: float | None = None
        #: ``participation.held_out``: the clients that never train (``seeding.held_out``, drawn once by the world)
        self.held_out = held_out
        self._population: list[int] = []  # (``populations``, per round)

    # ---- what goes down ---------------------------------------------------------------------------
    def chosen(self, t: int) -> np.ndarray:
        """The clients chosen for round ``t``: ``clients_per_round`` drawn among those with a task in that round's
        stage (a client whose task stream has ended drops out), or among all, never a held-out client."""
        live = self.calendar.live(t) if self.calendar is not None else None
        if len(self.held_out):
            live = np.setdiff1d(np.arange(self.num_clients) if live is None else live, self.held_out)
        return sample_cohort(self.num_clients, self.settings.train.clients_per_round, self.settings.seed, t, live)

    def populations(self, rounds: int) -> list[int]:
        """How many clients each of rounds 0..rounds-1 draws its cohort from (those ``chosen`` may pick): what the
        privacy accountant's sampling rate is of."""
        while len(self._population) < rounds:
            t = len(self._population)
            live = self.calendar.live(t) if self.calendar is not None else None
            self._population.append(len(np.setdiff1d(np.arange(self.num_clients) if live is None else live,
                                                     self.held_out)))
        return self._population[:rounds]

    def cohort(self, t: int) -> np.ndarray:
        """The clients of round ``t`` that answer: the chosen ones but those that drop out
        (``participation.dropout``)."""
        pc = self.settings.participation
        return drop_out(self.chosen(t), pc.dropout if pc else 0.0, self.num_clients, self.settings.seed, t)

    def lr(self, t: int) -> float:
        return self.algo.round_lr(self.state, t, self.settings.train.optimizer.lr_at(t) * self.plateau["scale"])

    def header(self, t: int, lr: float) -> dict:
        """The round header: the round, its learning rate, and in a task stream its stage and the classes the
        federation has met by then."""
        if self.calendar is None:
            return {"round": t, "lr": lr, "stage": None, "seen": None}
        stage = self.calendar.stage(t)
        return {"round": t, "lr": lr, "stage": stage, "seen": torch.as_tensor(self.calendar.seen_classes(stage))}

    def assign(self, clients: np.ndarray) -> dict:
        """The assignment of ``clients``: their ids and what the server sends each alone, stacked."""
        ids = torch.as_tensor(clients, device=self.device)
        return {"ids": ids, **self.algo.client_payload(self.state, ids)}

    def broadcast(self, t: int, shared: dict | None = None, buffers: bool = True) -> dict:
        """The broadcast of round ``t``: the algorithm's payload (with the exchange's answer ``shared``) and the
        server's BatchNorm statistics per architecture (by its id as a string), for models that have them."""
        return {"payload": {**self.algo.broadcast(self.state, t), **(shared or {})},
                "buffers": {str(g.gid): g.global_buffers for g in self.groups if g.global_buffers} if buffers else {}}

    def global_model(self) -> tuple[dict, dict] | None:
        """(parameters, BatchNorm buffers) of the global model clients predict with; None: each its own."""
        if not self.algo.global_model:
            return None
        return self.algo.global_params(self.state), self.groups[0].global_buffers

    # ---- what comes up ------------------------------------------------------------------------------
    def exchange(self, reply: dict, t: int) -> dict:
        """The server's answer to the cohort's logits on the public stream (``Algorithm.exchange``)."""
        return self.algo.exchange(self.state, reply["logits"], reply["ids"].to(self.device), t)

    def collect(self, parts: list[dict]) -> tuple:
        """The uploads of a round, one part per architecture: (cohort, uploads stacked, loss, steps, weights) in
        (architecture, id) order, and a global model's BatchNorm statistics as its architectures' clients sent
        them, [(group, stacked)] (``aggregate`` combines them)."""
        stats = [(g, p["buffers"]) for p in parts for g in [self.groups[self.group_index[p["arch"]]]]
                 if self.algo.global_model and g.global_buffers]
        return (np.concatenate([ids_of(p) for p in parts]), self._cat_uploads([p["upload"] for p in parts]),
                torch.cat([p["loss"] for p in parts]), torch.cat([p["steps"] for p in parts]).cpu().numpy(),
                torch.cat([p["n"] for p in parts]), stats)

    def _cat_uploads(self, uploads: list) -> dict:
        """The architecture groups' uploads as one stack: they must share a layout (logits, prototypes, statistics;
        the weights of different architectures are never stacked)."""
        layouts = {(str(tree_structure(u)), tuple((tuple(t.shape[1:]), t.dtype) for t in leaves(u))) for u in uploads}
        if len(layouts) > 1:
            raise ConfigError(f"algorithm {self.settings.algorithm!r} uploads differently shaped tensors from the "
                              "different architectures of model.heterogeneous; it needs one architecture")
        return cat_trees(uploads)

    def aggregate(self, t: int, lr: float, cohort: np.ndarray, up: dict, loss: torch.Tensor, steps: np.ndarray,
                  weights: torch.Tensor, stats: list = ()) -> None:
        """The new server state (``aggregate``) and BatchNorm statistics (``stats`` from ``collect``: weighted by
        the clients' sample counts, or through the robust rule with the parameters, as Flower's strategies see
        them in a state dict), its own training (``server_program``) and the plateau. A cohort whose clients hold
        no training sample (a skewed partition's empty clients) changes nothing: a weighted mean of nothing is
        0/0."""
        if not bool(weights.sum() > 0):
            return
        if (why := robust.short(self.settings, len(cohort))) is not None:
            warnings.warn(f"round {t}: aggregation: {why}; the round is skipped (the server keeps its state)",
                          stacklevel=2)
            return
        signals = Signals(torch.as_tensor(cohort, device=self.device), loss,
                          torch.as_tensor(steps, dtype=torch.float32, device=self.device), lr)
        s = self.settings
        ruled = s.aggregation is not None and s.aggregation.rule != "mean"  # (then no one client sets anything)
        stepped = s.aggregation is not None and s.aggregation.optimizer != "none"
        if ruled or stepped or s.privacy is not None or (s.attack is not None and s.attack.kind != "label_flip"):
            # the averaged part (``Algorithm.averages``), updates measured from what the server broadcast of it
            u_key, s_key = robust.averaged(type(self.algo))  # (setup refused the settings for any other algorithm)
            ref = {k: self.state[s_key][k] for k in up[u_key]}
            model = robust.attack(s, up[u_key], ref, cohort, t, self.num_clients)  # the attackers' first
            if s.privacy is not None and s.privacy.mode != "local":  # DP-FedAvg: clipped, averaged, noised
                model, self.dp_clip = robust.private(s, model, ref, t, self.dp_clip)  # (setup refuses statistics)
            elif ruled:  # (after local DP too: post-processing)
                (g, got), = stats or [(None, {})]  # (a global model: one architecture)
                floats = [k for k, v in got.items() if v.is_floating_point()]  # judged with the parameters
                joint, weights = robust.aggregate(s, {**model, **{_STAT + k: got[k] for k in floats}},
                                                  {**ref, **{_STAT + k: g.global_buffers[k] for k in floats}}, weights)
                model = {k: joint[k] for k in model}
                stats = [(g, {**got, **{k: joint[_STAT + k] for k in floats}})] if g is not None else []
            if s.privacy is not None and s.privacy.mode == "local":  # clipped and noised by each client: DP-FedAvg's
                weights = (weights > 0).to(weights) if ruled else torch.ones_like(weights)  # uniform mean
            up = {**up, u_key: model}
        buffers = [(g, average_buffers(got, weights, "median" if ruled else "max")) for g, got in stats]
        state = self.algo.aggregate(self.state, up, weights, t, signals)
        changed = next(((b, a) for b, a in zip_longest(layout(self.state), layout(state)) if a != b), None)
        if changed:  # (a plug-in's aggregate; a checkpoint, the next broadcast and a resume need the same layout)
            raise ConfigError(f"algorithm {s.algorithm!r}: aggregate returned a server state of another layout "
                              f"({_shown(changed[1])} where the state had {_shown(changed[0])}); it must return the "
                              "state's keys with their shapes and dtypes")
        opt_state = self.opt_state
        if stepped:
            model, opt_state = robust.server_step(s, self.opt_state, ref, {k: state[s_key][k] for k in ref}, t)
            state = {**state, s_key: {**state[s_key], **model}}
        if not all_finite((state, opt_state, [b for _, b in buffers])):  # (finite uploads can overflow it, e.g.
            # a server optimizer's squared update: such a state is never kept, broadcast or saved)
            warnings.warn(f"round {t}: the aggregate of clients {cohort.tolist()[:10]} is not finite (their updates "
                          "overflow); the round is skipped (the server keeps its state); an aggregation rule "
                          "(norm_bound, median, krum) bounds what one client can move", stacklevel=2)
            return
        self.state, self.opt_state = state, opt_state
        for g, b in buffers:
            g.global_buffers = b
        phases = self.algo.server_program(self.state, t)
        if phases:
            self._train(phases, up, cohort, lr, t)
        self._track_plateau(t, float(loss.median() if ruled else loss.mean()))  # (client-reported losses)

    def _train(self, phases, uploads: dict, cohort: np.ndarray, lr: float, t: int) -> None:
        """The server's own training after aggregation (``Algorithm.server_program``): the global model trained on
        the public stream as a cohort of one, against the payload ``exchange`` makes of the uploaded models'
        logits on the stream."""
        g = self.groups[0]
        g.module.train()
        x = self.transform(self.public.x)
        logits = g.trainer.outputs(x, uploads["model"], g.global_buffers_like(len(cohort)), self.batch)
        shared = self.algo.exchange(self.state, logits, torch.as_tensor(cohort, device=self.device), t)
        one = tmap(lambda v: v.unsqueeze(0), self.state["model"])
        trained = g.trainer.server_train(one, {**self.algo.broadcast(self.state, t), **shared}, phases,
                                         g.global_buffers_like(1), lr=lr, seed=self.settings.seed, round_idx=t)
        self.state = {**self.state, "model": tmap(lambda v: v[0], trained)}

    def _track_plateau(self, t: int, loss: float) -> None:
        """``train.optimizer.plateau``: torch's ReduceLROnPlateau on the cohort's mean loss (under a robust rule
        its median: the losses are client-reported) (relative threshold 1e-4) from the ``skip``-th round (of the
        run, or of each task) on; a new task starts it afresh."""
        opt = self.settings.train.optimizer
        if opt.plateau is None:
            return
        p, pc = self.plateau, opt.plateau
        if (t % self.calendar.rounds_per_task if self.calendar is not None else t) >= pc.skip:
            if loss < p["best"] * (1 - 1e-4):
                p["best"], p["bad"] = loss, 0
            else:
                p["bad"] += 1
            if p["bad"] > pc.patience:
                floor = pc.min_lr / opt.lr_at(t + 1)
                p["scale"], p["bad"] = min(p["scale"], max(p["scale"] * pc.factor, floor)), 0
        if self.calendar is not None and self.calendar.task_ends(t):
            self.plateau = {"scale": 1.0, "best": float("inf"), "bad": 0}


def _shown(entry) -> str:
    """A ``layout`` entry as a reader knows it: 'model/fc.weight (5, 8) float32', or 'nothing'."""
    if entry is None:
        return "nothing"
    at, shape, dtype = entry
    return f"{at.lstrip('/') or 'the state'} {shape}" + (f" {str(dtype).removeprefix('torch.')}" if dtype else "")
