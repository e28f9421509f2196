"""The wire pool (:class:`WirePool`): each client (or each shard of clients) in a runtime of its own, every message
through the codec as bytes — the proof that nothing crosses between the server and its clients except messages. A
runtime exists while its clients have messages (at most a round's cohort); one that leaves keeps its state in a temp
file, as a deployed node does."""

from __future__ import annotations

import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from ...files import atomic_write
from ...protocol import codec
from ...protocol.tree import take, to
from ..client.runtime import ClientRuntime, NonFiniteLoss
from ..messages import (
    EvalMerge,
    ids_of,
    merge_logits,
    order_parts,
    row,
    sub_request,
    upload_of,
)
from .local import InProcessPool


class WirePool:
    """Each runtime hosts its own clients; every message to it and every answer from it travels as bytes through
    the codec (``protocol.codec``). A round's messages are those :func:`traffic` counts — to each client the
    header, the packed broadcast and its assignment; from each its packed upload (and its logits) — and
    ``traffic[action]`` adds up the bytes each action sent down and up. (The K x K cross matrix needs every
    client's test split in one place: a simulation-only measurement, refused before a wire pool is built.)

    A runtime exists only while its clients have messages, as on a deployed node: ``make(shard)`` builds it when a
    message reaches one of its clients, and at most ``keep`` stay built; the one used least recently then leaves,
    its state (``ClientRuntime.state``, codec bytes) kept in a file of a temporary folder — as a node keeps it — and
    loaded into the runtime built for its clients' next message. So a run of 10,000 clients starts at once and
    holds the runtimes of the clients it serves, not one per client."""

    def __init__(self, make, shards: list[np.ndarray], hosted: list, algo, device: torch.device, keep: int):
        self.make, self.shards, self._hosted = make, shards, hosted
        self.algo, self.device, self.keep = algo, device, max(1, keep)
        self.built: OrderedDict[int, ClientRuntime] = OrderedDict()
        self.traffic: dict[str, list[int]] = {}
        self._owner = np.full(max((int(h.clients.max()) + 1 for h in hosted if len(h.clients)), default=0), -1,
                              dtype=np.int64)
        for i, h in enumerate(hosted):
            self._owner[h.clients] = i  # per client id the shard hosting it
        self._left: set[int] = set()  # the shards whose state is in a file
        self._dir: tempfile.TemporaryDirectory | None = None

    notes, meta = InProcessPool.notes, InProcessPool.meta

    def hosted(self) -> list:
        return list(self._hosted)

    def runtime(self, i: int) -> ClientRuntime:
        """Shard ``i``'s runtime, built (with its state, if it left) when it is not."""
        rt = self.built.pop(i, None)
        if rt is None:
            rt = self.make(self.shards[i])
            if i in self._left:
                rt.load(to(codec.decode(self._file(i).read_bytes(), "store")[1], rt.device))
        self.built[i] = rt
        while len(self.built) > self.keep:
            j, old = self.built.popitem(last=False)
            if self._dir is None:
                self._dir = tempfile.TemporaryDirectory(prefix="fedmosaic-wire-")
            atomic_write(self._file(j), codec.encode("store", old.state()), durable=False)  # scratch
            self._left.add(j)
        return rt

    def _file(self, i: int) -> Path:
        return Path(self._dir.name) / f"shard_{i}.fmsg"

    def close(self) -> None:
        self.built.clear()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir, self._left = None, set()

    def _wire(self, action: str, up: bool, kind: str, body, device: torch.device):
        data = codec.encode(kind, body)
        self.traffic.setdefault(action, [0, 0])[up] += len(data)
        _, out = codec.decode(data, kind)
        return to(out, device)

    def _down(self, action: str, rt: ClientRuntime, **messages) -> list:
        return [self._wire(action, False, kind, body, rt.device) for kind, body in messages.items()]

    def _call(self, rt: ClientRuntime, action: str, *args):
        """An action outside a round's training (warm-up, task end, evaluation, checkpoint): its arguments as one
        message, its answer as another."""
        (args,) = self._down(action, rt, request=list(args))
        reply = getattr(rt, action)(*args)
        return None if reply is None else self._wire(action, True, "reply", reply, self.device)

    def _each(self, assignment: dict):
        """(runtime, its rows of ``assignment``) of every shard with a client in it, in shard order."""
        owners = self._owner[ids_of(assignment)]
        order = np.argsort(owners, kind="stable")  # the rows of each shard together, in their order
        shards, first = np.unique(owners[order], return_index=True)
        for i, rows in zip(shards, np.split(order, first[1:]), strict=True):
            yield self.runtime(int(i)), take(assignment, torch.as_tensor(rows, device=assignment["ids"].device))

    def _pack(self, broadcast: dict) -> dict:
        return {**broadcast, "payload": self.algo.pack_broadcast(broadcast["payload"])}

    def warm_up(self, lr: float, assignment: dict) -> None:
        for rt, mine in self._each(assignment):
            self._call(rt, "warm_up", lr, mine)

    def public_logits(self, broadcast: dict, assignment: dict, round_idx: int) -> dict:
        packed, rows = self._pack(broadcast), []
        for rt, mine in self._each(assignment):
            bc, a = self._down("public_logits", rt, broadcast=packed, assignment=mine)
            reply = rt.public_logits({**bc, "payload": rt.algo.unpack_broadcast(bc["payload"])}, a)
            rows += [self._wire("public_logits", True, "logits", row(reply, i), self.device)
                     for i in range(len(reply["ids"]))]
        return merge_logits(rows)

    def train(self, header: dict, broadcast: dict, assignment: dict) -> list[dict]:
        packed, uploads, failed = self._pack(broadcast), [], []
        for rt, mine in self._each(assignment):
            h, bc, a = self._down("train", rt, header=header, broadcast=packed, assignment=mine)
            try:
                parts = rt.train(h, {**bc, "payload": rt.algo.unpack_broadcast(bc["payload"])}, a)
            except NonFiniteLoss:
                failed += ids_of(mine).tolist()
                continue
            for p in parts:
                for i in range(len(p["ids"])):
                    got = self._wire("train", True, "upload", upload_of(rt.algo, p, i), self.device)
                    uploads.append({**got, "upload": self.algo.unpack_upload(got["upload"])})
        if failed:
            raise NonFiniteLoss(f"round {header['round']}: non-finite loss or update on clients {failed[:10]}")
        return order_parts(uploads)

    def end_task(self, header: dict, payload: dict, assignment: dict, model) -> None:
        for rt, mine in self._each(assignment):
            self._call(rt, "end_task", header, payload, mine, model)

    def evaluate(self, request: dict) -> dict:
        merged = EvalMerge(request)
        for rt, mine in self._each(request["assignment"]):  # (one runtime after the other: at most keep built)
            sub = sub_request(request, mine, rt.clients)
            merged.add(self._call(rt, "evaluate", sub), sub)
        return merged.result()

    def state(self) -> list[dict]:
        return [self._call(self.runtime(i), "state") for i in range(len(self.shards))]

    def load(self, parts: list[dict]) -> None:
        for i, part in zip(range(len(self.shards)), parts, strict=True):
            self._call(self.runtime(i), "load", part)
