"""The client side of a round: a runtime hosting some clients — all of them, a shard, or one — with their data,
their architecture groups and trainers, and their store (algorithm state, BatchNorm buffers, exemplar memory).

It acts only on messages (``protocol.messages``): it reads what the server sent (the broadcast, the clients'
assignments, the round header) and answers with uploads and replies; it never sees the server's state, and the
server never sees its data or store. Client ids are global everywhere: a runtime's data splits keep one row range
per client of the federation (empty for the clients it does not host), so ``sizes[k]`` and ``ptr[k]`` mean the
same on every runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...errors import FedMosaicError
from ...protocol.algorithm import Algorithm
from ...protocol.tree import finite, put, repeat, take, tmap
from .. import evaluate as ev
from .. import robust
from ..group import Group
from ..mapping import for_each_client
from ..messages import ids_of, order_parts
from ..seeding import MEMORY, rng
from ..tensors import ClientTensors
from . import memory as mem

if TYPE_CHECKING:
    from ..settings import RoundSettings


class NonFiniteLoss(FedMosaicError):
    pass


@dataclass(frozen=True)
class Hosted:
    """Which clients a runtime hosts: per architecture group (gid, ids), in (architecture, id) order, and whether
    they keep an exemplar memory — what a checkpoint's rows are cut to for it."""

    groups: tuple[tuple[int, np.ndarray], ...]
    memory: bool

    @property
    def clients(self) -> np.ndarray:
        return np.concatenate([ids for _, ids in self.groups]) if self.groups else np.zeros(0, dtype=np.int64)


class ClientRuntime:
    """``groups``: the hosted clients' architecture groups (each with its store, buffers and trainer, only the
    hosted clients' rows); ``split``: train/val/test of the hosted clients (global ids); ``tasks``: per client of
    the federation its task stream (empty for clients not hosted), or None; ``exemplars``: likewise its exemplar
    memory, or None; ``global_test``: the dataset's test split, for the evaluations only a simulation makes
    (continual accuracy of personal models)."""

    def __init__(self, settings: RoundSettings, algo: Algorithm, groups: list[Group], split: dict, num_clients: int,
                 num_classes: int, batch: int, transform, public, device, tasks=None, exemplars=None, global_test=None):
        self.settings, self.algo, self.groups, self.split = settings, algo, groups, split
        self.num_clients, self.num_classes, self.batch = num_clients, num_classes, batch
        self.transform, self.public, self.device = transform, public, device
        self.tasks, self.exemplars, self.global_test = tasks, exemplars, global_test
        self.group_of = np.full(num_clients, -1, dtype=np.int64)
        self.row_of = np.zeros(num_clients, dtype=np.int64)
        for g in groups:
            self.group_of[g.clients] = g.gid
            self.row_of[g.clients] = np.arange(len(g.clients))

    @property
    def clients(self) -> np.ndarray:
        """The hosted clients in (architecture, id) order."""
        return np.concatenate([g.clients for g in self.groups]) if self.groups else np.zeros(0, dtype=np.int64)

    # ---- what a client knows of itself ------------------------------------------------------------
    def train_split(self, stage: int | None, memory: bool = True) -> ClientTensors:
        """What the hosted clients may train on at ``stage``: their whole train split, or their current task's
        samples and (``memory``) the samples their exemplar memory keeps. A client whose stream has ended has none."""
        tr = self.split["train"]
        if self.tasks is None:
            return tr

        def offsets(k: int, task: np.ndarray) -> np.ndarray:
            kept = self.exemplars[k] if memory and self.exemplars is not None else None
            return np.union1d(task, mem.offsets_of(kept)) if kept else task

        return replace(tr, subset={k: offsets(k, st[stage][2]) for k, st in enumerate(self.tasks)
                                   if stage < len(st) and st[stage] is not None})

    def own(self, assignment: dict, members: np.ndarray, header: dict | None = None) -> dict:
        """The per-client payload of ``members`` (their rows of ``assignment``) with their ids — and in a round of
        a task stream (``header``) the classes they are told of (:meth:`_classes`)."""
        ids = ids_of(assignment)
        sent = {k: v for k, v in assignment.items() if k != "ids"}
        if len(ids) != len(members) or not np.array_equal(ids, members):
            sent = take(sent, torch.as_tensor(np.searchsorted(ids, members), device=self.device))
        told = self._classes(members, header) if header is not None and self.tasks is not None else {}
        return {**sent, "cid": torch.as_tensor(members, device=self.device), **told}

    def _classes(self, clients: np.ndarray, header: dict) -> dict:
        """[n, C] 1/0 each: ``task_classes`` the classes of each client's task at the header's stage,
        ``memory_classes`` those its exemplar memory holds samples of, ``seen_classes`` those the federation has
        met by then (sent in the header) — from which a classification term picks its output columns
        (``LocalContext.classes``). Metadata, not counted as sent."""
        n, C, stage = len(clients), self.num_classes, header["stage"]
        task, kept = np.zeros((n, C), dtype=np.float32), np.zeros((n, C), dtype=np.float32)
        for i, k in enumerate(clients):
            st, memory = self.tasks[k], self.exemplars[k] if self.exemplars is not None else {}
            task[i, st[stage][1] if stage < len(st) and st[stage] is not None else []] = 1
            kept[i, [c for c, offs in memory.items() if len(offs)]] = 1
        seen = np.repeat(header["seen"].cpu().numpy().astype(np.float32)[None], n, 0)
        return {k: torch.as_tensor(v, device=self.device)
                for k, v in (("task_classes", task), ("memory_classes", kept), ("seen_classes", seen))}

    def by_group(self, ids: np.ndarray):
        for g in self.groups:
            members = ids[self.group_of[ids] == g.gid]
            if len(members):
                yield g, members

    def _rows(self, members: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(self.row_of[members], device=self.device)

    # ---- actions ------------------------------------------------------------------------------------
    def warm_up(self, lr: float, assignment: dict) -> None:
        """Before round 0: every hosted client's own model trained on its private data (``train.warmup_epochs``)."""
        for g in self.groups:
            g.module.train()
            trained = g.trainer.warm_up(self.split["train"], g.clients, self.own(assignment, g.clients), g.store,
                                        g.buffers, epochs=self.settings.train.warmup_epochs, lr=lr,
                                        seed=self.settings.seed)
            g.store = for_each_client(self.algo.after_warmup, (0,), False)({**g.store, "model": trained})

    def public_logits(self, broadcast: dict, assignment: dict) -> dict:
        """LogitsReply: ``logits`` [n, N0, C] of the assigned clients on the public stream at the parameters they
        start the round from, their ``ids`` and ``arch``, in (architecture, id) order."""
        out, order, arch, x = [], [], [], self.transform(self.public.x)
        payload = broadcast["payload"]
        for g, members in self.by_group(ids_of(assignment)):
            rows = self._rows(members)
            params = g.trainer.start(payload, self.own(assignment, members), take(g.store, rows))
            g.module.train()
            out.append(g.trainer.outputs(x, params["model"], take(g.buffers, rows), self.batch))
            order.append(members)
            arch.append(np.full(len(members), g.gid))
        return {"ids": torch.as_tensor(np.concatenate(order)), "arch": torch.as_tensor(np.concatenate(arch)),
                "logits": torch.cat(out)}

    def train(self, header: dict, broadcast: dict, assignment: dict) -> list[dict]:
        """The assigned clients' local round. Returns the Upload: per architecture group its part — ``arch``,
        ``ids``, the algorithm's ``upload``, ``loss``, ``steps``, ``terms``, ``n`` (the samples each trained on:
        its aggregation weight) and ``buffers`` (the BatchNorm statistics it ends with, when the model is global).

        Nothing is kept unless every client's loss and upload are finite (then :class:`NonFiniteLoss`)."""
        t, lr, pc = header["round"], header["lr"], self.settings.participation
        train = self.train_split(header["stage"]) if self.tasks is not None else self.split["train"]
        payload, parts = broadcast["payload"], []
        for g, members in self.by_group(ids_of(assignment)):
            rows = self._rows(members)
            # global-model algorithms start the cohort from the server's running statistics
            server_bufs = broadcast["buffers"].get(str(g.gid), {})
            bufs = repeat(server_bufs, len(members)) if self.algo.global_model else take(g.buffers, rows)
            own, pay = self.own(assignment, members, header), payload
            if server_bufs:  # the running statistics of the teachers a client may distil from (frozen copies)
                pay = {**payload, "global_buffers": server_bufs}
                own = {**own, "local_buffers": take(g.buffers, rows), "task_buffers": take(g.task_buffers, rows)}
            g.module.train()
            out = g.trainer.train(train, members, pay, take(g.store, rows), bufs, own=own,
                                  program=self.algo.program(t), probes=self.algo.probes(t, pay), lr=lr,
                                  seed=self.settings.seed, round_idx=t,
                                  stragglers=pc.stragglers if pc else 0.0)
            parts.append((g, members, out, bufs))
        self._check_finite(t, parts)
        uploads, p = [], self.settings.privacy
        for g, members, out, bufs in parts:
            put((g.store, g.buffers), self._rows(members), (out.states, bufs))
            up = out.uploads if p is None or p.mode != "local" else \
                robust.local(self.settings, out.uploads, payload["global"], members, t)
            uploads.append({"arch": g.gid, "ids": torch.as_tensor(members), "upload": up, "loss": out.loss,
                            "steps": torch.as_tensor(out.steps), "terms": out.terms,
                            "n": torch.as_tensor(train.counts(members), dtype=torch.float32, device=self.device),
                            "buffers": bufs if self.algo.global_model else {}})
        return uploads

    @staticmethod
    def _check_finite(t: int, parts: list) -> None:
        cohort = np.concatenate([members for _, members, _, _ in parts])
        loss = torch.cat([out.loss for _, _, out, _ in parts])
        bad = ~torch.isfinite(loss)
        # the round's one host sync: every flag on the device first, then one read
        oks = [~bad.any(), *finite([out.uploads for _, _, out, _ in parts])]
        if not bool(torch.stack([ok.to(loss.device) for ok in oks]).all()):
            who = cohort[bad.cpu().numpy()] if bad.any() else cohort
            raise NonFiniteLoss(f"round {t}: non-finite loss or update on clients {who.tolist()[:10]}")

    def end_task(self, header: dict, payload: dict, assignment: dict, model: dict | None) -> None:
        """The last round of a task is over: every hosted client's memory keeps the best of the task's samples under
        the model it predicts with (``model``: the global one, with its buffers; None: its own), the algorithm's
        task probes run over them and ``end_task`` updates its state. ``payload``: the broadcast after aggregation."""
        t, stage, tr, dev = header["round"], header["stage"], self.split["train"], self.device
        task = self.train_split(stage, memory=False)
        seen = header["seen"].to(device=dev, dtype=torch.float32)
        probes = self.algo.task_probes()
        mc = self.settings.memory
        how = self.algo.memory_select if mc is None or mc.select == "auto" else mc.select
        for g in self.groups:
            g.module.eval()  # features and probes at the running statistics, which they leave alone
            params, bufs = self.predictors(g, t, payload, assignment, model)
            if self.exemplars is not None:
                for k, z in zip(g.clients, g.trainer.features(task, g.clients, params, bufs), strict=True):
                    st = self.tasks[k]
                    if stage >= len(st) or st[stage] is None:
                        continue
                    offs = st[stage][2]
                    labels = tr.y[torch.as_tensor(tr.ptr[k] + offs, device=dev)].cpu().numpy()
                    new = {int(c): z[torch.as_tensor(labels == c, device=dev)] for c in np.unique(labels)}
                    self.exemplars[k] = mem.refresh(self.exemplars[k], new, {c: offs[labels == c] for c in new}, how,
                                                    mc.per_class, mc.total,
                                                    rng(self.settings.seed, MEMORY, stage, int(k)))
            stats = g.trainer.probe_at(task, g.clients, {"model": params}, g.store, payload,
                                       self.own(assignment, g.clients, header), bufs, probes, seed=self.settings.seed,
                                       round_idx=t) if probes else {}
            g.store = for_each_client(lambda s, p, st: self.algo.end_task(s, p, st, seen, payload), (0, 0, 0),
                                      g.trainer.vectorize, fresh=True)(g.store, params, stats)
            g.task_buffers = tmap(torch.clone, bufs)

    # ---- evaluation ---------------------------------------------------------------------------------
    def predictors(self, g: Group, t: int, payload: dict, assignment: dict, model: dict | None,
                   n: int | None = None) -> tuple[dict, dict]:
        """(parameters, buffers) of the model each client of ``g`` predicts with, stacked: the global ``model``
        (``(params, buffers)``; ``n`` copies, default one per client), or its personal one."""
        n = len(g.clients) if n is None else n
        if model is not None:
            params, bufs = model
            return repeat(params, n), repeat(bufs, n)
        return self.personal(g, t, payload, assignment), g.buffers

    def personal(self, g: Group, t: int, payload: dict, assignment: dict) -> dict:
        """Every client's personal model in group ``g`` (stacked): fine-tuned from ``local_init`` when the
        algorithm fine-tunes before evaluation, else ``personal_params`` of its state and what it was sent."""
        phases, own = self.algo.finetune(), self.own(assignment, g.clients)
        if phases is not None:  # the fine-tuned "model" slot, or the slots' union (a model cut in parts: FedBABU)
            out = g.trainer.adapt(self.split["train"], g.clients, payload, own, g.store, g.buffers, program=phases,
                                  lr=self.settings.train.optimizer.lr_at(t), seed=self.settings.seed, round_idx=t)
            return out["model"] if "model" in out else {k: v for tree in out.values() for k, v in tree.items()}
        return for_each_client(lambda s, o: self.algo.personal_params(s, {**payload, "own": o}), (0, 0),
                               g.trainer.vectorize)(g.store, own)

    def evaluate(self, request: dict) -> dict:
        """EvalReply to an EvalRequest: per client of the federation (zeros for clients not hosted) its test and
        validation ``sizes``, the correct predictions of the global model (``request["global"]``: params and
        buffers) on its test and validation splits, of its personal model on them (``personal``), the K x K cross
        matrix rows it hosts (``cross``), the hits of its personal model on the global test rows dealt to it
        (``continual``: ``rows`` per hosted client in (architecture, id) order, ``unseen`` classes masked), and
        ``report``: its clients' reports."""
        t, payload, assignment = request["round"], request["payload"], request["assignment"]
        K, out = self.num_clients, {}
        logits_fn = lambda z, logits: self.algo.eval_logits(z, logits, payload)
        for g in self.groups:
            g.module.eval()  # BatchNorm: use the running statistics, do not update them
        test, val = self.split["test"], self.split["val"]
        # per client its split sizes (zeros for the clients hosted elsewhere: replies add up)
        out["sizes"] = {"test": torch.as_tensor(test.sizes), "val": torch.as_tensor(val.sizes)}
        if request.get("global") is not None:
            params, bufs = request["global"]
            gp, g0 = {**params, **bufs}, self.groups[0]
            transform, batch = g0.trainer.judging
            for key, split in (("global_clients", test), ("global_val", val)):
                if request[key] and len(split.y):
                    ok, _ = ev.score_samples(g0.apply, gp, split.x, split.y, transform, logits_fn, False, batch)
                    out[key] = torch.as_tensor(ev.per_client_correct(ok, split.ptr))
        splits = {k: sp for k, sp in (("personal", test), ("personal_val", val)) if request.get(k) and len(sp.y)}
        cross = np.zeros((K, K)) if request.get("cross") and splits else None
        if splits:
            correct = {k: np.zeros(K) for k in splits}
            for g in self.groups:
                mine = {**self.personal(g, t, payload, assignment), **g.buffers}
                apply = partial(self.algo.personal_forward, partial(g.apply, slot=self.algo.personal_slot))
                transform, batch = g.trainer.judging
                if cross is not None:
                    cross[g.clients] = ev.cross_correct(apply, mine, test.x, test.y, test.ptr, transform,
                                                        logits_fn, g.trainer.vectorize, batch)
                for k, sp in splits.items():
                    if k == "personal" and cross is not None:  # the matrix's diagonal: measured already
                        correct[k][g.clients] = cross[g.clients, g.clients]
                        continue
                    correct[k][g.clients] = ev.personal_correct(apply, mine, sp.x, sp.y, sp.ptr, g.clients,
                                                                transform, logits_fn, g.trainer.vectorize,
                                                                batch=batch)
            out.update({k: torch.as_tensor(v) for k, v in correct.items()})
        if cross is not None:
            out["cross"] = torch.as_tensor(cross)
        if request.get("continual") is not None:
            out["continual"] = torch.as_tensor(self._continual_hits(t, payload, assignment, request["continual"]))
        if request.get("report") and self.groups:  # in client order (the groups answer in architecture order)
            (out["report"],) = order_parts([
                {"ids": torch.as_tensor(g.clients),
                 "reports": for_each_client(self.algo.client_report, (0,), g.trainer.vectorize)(g.store)}
                for g in self.groups])
        return out

    def _continual_hits(self, t: int, payload: dict, assignment: dict, request: dict) -> np.ndarray:
        """[n, m] whether each hosted client's personal model (in (architecture, id) order) predicts its dealt rows
        of the global test set right, choosing among the classes met so far."""
        x, y = self.global_test
        unseen = request["unseen"].to(self.device)
        rows, lo, hits = request["rows"].cpu().numpy(), 0, []

        def masked(z, logits):
            return self.algo.eval_logits(z, logits, payload).masked_fill(unseen, float("-inf"))

        for g in self.groups:
            g.module.eval()
            k = len(g.clients)
            params, bufs = self.predictors(g, t, payload, assignment, None)
            mine = torch.as_tensor(rows[lo : lo + k], device=self.device)
            lo += k
            transform, batch = g.trainer.judging
            hits.append(ev.judged_correct(partial(self.algo.personal_forward, g.apply), {**params, **bufs}, x, y,
                                          mine, transform, g.trainer.vectorize, masked, batch).cpu().numpy())
        return np.concatenate(hits)

    # ---- store --------------------------------------------------------------------------------------
    def hosted(self) -> Hosted:
        return Hosted(tuple((g.gid, g.clients) for g in self.groups), self.exemplars is not None)

    def state(self) -> dict:
        """The hosted clients' part of a checkpoint: per group its ids, store and buffers, and their memories."""
        return {"groups": [{"arch": g.gid, "ids": torch.as_tensor(g.clients), "store": g.store, "buffers": g.buffers,
                            "task_buffers": g.task_buffers} for g in self.groups],
                "memory": None if self.exemplars is None else [mem.pack(self.exemplars[k]) for k in self.clients]}

    def load(self, state: dict) -> None:
        """Take back :meth:`state`'s layout (rows for exactly the hosted clients)."""
        for g, part in zip(self.groups, state["groups"], strict=True):
            if part["arch"] != g.gid or not np.array_equal(ids_of(part), g.clients):
                raise ValueError("a client store for other clients than this runtime hosts")
            g.store, g.buffers, g.task_buffers = part["store"], part["buffers"], part["task_buffers"]
        if self.exemplars is not None:
            for k, m in zip(self.clients, state["memory"], strict=True):
                self.exemplars[k] = mem.unpack(m)
