"""Client pools: where the server's messages go and where the clients' answers come from.

A pool offers the client actions of a round — ``warm_up``, ``public_logits``, ``train``, ``end_task``,
``evaluate`` — over the clients it hosts, and the clients' part of a checkpoint. The driver
(``federation.Federation``) hands it the server runtime's messages (``server.ServerRuntime``) and the server its
answers; neither side touches the other's state.

:class:`InProcessPool` hosts every client in one :class:`~.client.ClientRuntime` and hands the messages over as
they are: the stacked, vmapped, chunked fast path of the simulator. :class:`WirePool` hosts each client (or each
shard of clients) in a runtime of its own and passes every message through the codec as bytes — the proof that
nothing crosses between the server and its clients except messages. Both answer in the same order, (architecture,
client id), so the server's arithmetic is the same whichever pool served it.
"""

from __future__ import annotations

import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from ..files import atomic_write
from ..protocol import codec
from ..protocol.algorithm import Algorithm
from ..protocol.tree import nbytes, take, tmap, to
from .client import ClientRuntime, NonFiniteLoss, ids_of, order_parts


def row(message: dict, i: int) -> dict:
    """Client ``i``'s row of a stacked message (a stack of one; a part's architecture id, an int, stays as it is)."""
    return {k: v if isinstance(v, int) else tmap(lambda t: t[i : i + 1], v) for k, v in message.items()}


def upload_of(algo, part: dict, i: int) -> dict:
    """The upload message of client ``i`` of an upload part, as it travels (``Algorithm.pack_upload``)."""
    one = row(part, i)
    return {**one, "upload": algo.pack_upload(one["upload"])}


def traffic(algo, n: int, header: dict, broadcast: dict, assignment: dict, parts: list[dict],
            public: tuple[dict, dict] | None = None) -> dict:
    """A round's bytes per direction, as the wire pool sends them: to each of the ``n`` cohort clients the header,
    the (packed) broadcast and its assignment, and (``public``: the broadcast before the exchange and the logits
    reply) the request for its logits on the public stream; from each its upload and its logits. ``bytes_*``: the
    encoded messages; ``payload_bytes_*``: their tensors, without the protocol's bookkeeping (ids, header, loss,
    steps, sample counts, terms). Every client's row has the same shapes, so one row is sized and counted n times,
    except for an algorithm that packs its uploads to each client's own shapes (``Algorithm.pack_upload``)."""
    bc = {**broadcast, "payload": algo.pack_broadcast(broadcast["payload"])}
    sent = {k: v for k, v in assignment.items() if k != "ids"}
    assigned = codec.size("assignment", row(assignment, 0))  # every client's row has the same shapes
    down = n * (codec.size("header", header) + codec.size("broadcast", bc) + assigned)
    payload_down = n * nbytes(bc) + nbytes(sent)
    packs = type(algo).pack_upload is not Algorithm.pack_upload
    up = payload_up = 0
    for p in parts:
        k = len(p["ids"])
        for i in range(k if packs else 1):
            msg = upload_of(algo, p, i)
            up += codec.size("upload", msg) * (1 if packs else k)
            payload_up += nbytes((msg["upload"], msg["buffers"])) * (1 if packs else k)
    if public is not None:
        before, reply = public
        bc0 = {**before, "payload": algo.pack_broadcast(before["payload"])}
        down += n * (codec.size("broadcast", bc0) + assigned)
        payload_down += n * nbytes(bc0) + nbytes(sent)
        up += n * codec.size("logits", row(reply, 0))
        payload_up += nbytes(reply["logits"])
    return {"bytes_down": down, "bytes_up": up, "payload_bytes_down": payload_down, "payload_bytes_up": payload_up}


def rows_of(assignment: dict, clients: np.ndarray) -> dict | None:
    """The rows of an assignment for the runtime hosting ``clients`` (None: none of them is in it)."""
    hosted = np.flatnonzero(np.isin(ids_of(assignment), clients))
    return take(assignment, torch.as_tensor(hosted, device=assignment["ids"].device)) if len(hosted) else None


def merge_logits(rows: list[dict]) -> dict:
    """One LogitsReply from the replies of several clients (or runtimes), in (architecture, client id) order."""
    parts = order_parts([{"arch": int(r["arch"]), "ids": r["ids"], "logits": r["logits"]} for r in rows])
    return {"ids": torch.cat([p["ids"] for p in parts]),
            "arch": torch.cat([torch.full_like(p["ids"], p["arch"]) for p in parts]),
            "logits": torch.cat([p["logits"] for p in parts])}


def sub_request(request: dict, assignment: dict, clients: np.ndarray) -> dict:
    """The EvalRequest for a runtime hosting ``clients`` (in its (architecture, id) order): their rows of the
    assignment, and of the continual request (whose rows follow the request's order of client ``ids``)."""
    sub = {**request, "assignment": assignment}
    continual = request.get("continual")
    if continual is not None:
        order = {int(k): i for i, k in enumerate(ids_of(continual))}
        pos = torch.as_tensor([order[int(k)] for k in clients], dtype=torch.int64)
        sub["continual"] = {**continual, "ids": continual["ids"][pos], "rows": continual["rows"][pos]}
    return sub


class EvalMerge:
    """One EvalReply to ``request`` from the replies of several runtimes, added reply by reply (:meth:`add`: a
    reply and the sub-request it answers; a pool of 10,000 runtimes holds one sum, not 10,000 replies): per-client
    counts added up (each runtime has zeros for the clients it does not host), continual hits back in the
    request's order of clients, the reports in client order (:meth:`result`)."""

    def __init__(self, request: dict):
        self.out: dict = {}
        self.hits, self.at, self.reports = [], [], []
        self.order = {} if request.get("continual") is None else {
            int(k): i for i, k in enumerate(ids_of(request["continual"]))}

    def add(self, reply: dict, sub: dict) -> None:
        for k, v in reply.items():
            if k == "continual":
                self.hits.append(v)
                self.at.append([self.order[int(c)] for c in ids_of(sub["continual"])])
            elif k == "report":
                self.reports.append(v)
            else:
                self.out[k] = tmap(torch.add, self.out[k], v) if k in self.out else v

    def result(self) -> dict:
        out = dict(self.out)
        if self.hits:
            out["continual"] = torch.cat(self.hits)[torch.as_tensor(np.argsort(np.concatenate(self.at), kind="stable"))]
        if self.reports:
            (out["report"],) = order_parts(self.reports)
        return out


def merge_evaluations(request: dict, replies: list[tuple[dict, dict]]) -> dict:
    """:class:`EvalMerge` of (reply, the sub-request it answers) pairs."""
    merged = EvalMerge(request)
    for reply, sub in replies:
        merged.add(reply, sub)
    return merged.result()


class InProcessPool:
    """Every client in one runtime: the messages go in and out as they are — no copies, no codec."""

    def __init__(self, runtime: ClientRuntime):
        self.runtime = runtime
        self.runtimes = [runtime]

    def notes(self) -> dict:
        """What a round's record says of the pool itself (a deployment: who answered): nothing here."""
        return {}

    def meta(self) -> dict:
        """What ``meta.json`` records of the pool (a deployment's driver and nodes): nothing here."""
        return {}

    def warm_up(self, lr: float, assignment: dict) -> None:
        self.runtime.warm_up(lr, assignment)

    def public_logits(self, broadcast: dict, assignment: dict, round_idx: int) -> dict:
        return self.runtime.public_logits(broadcast, assignment)

    def train(self, header: dict, broadcast: dict, assignment: dict) -> list[dict]:
        return self.runtime.train(header, broadcast, assignment)

    def end_task(self, header: dict, payload: dict, assignment: dict, model) -> None:
        self.runtime.end_task(header, payload, assignment, model)

    def evaluate(self, request: dict) -> dict:
        return self.runtime.evaluate(request)

    def state(self) -> list[dict]:
        return [self.runtime.state()]

    def load(self, parts: list[dict]) -> None:
        self.runtime.load(parts[0])

    def close(self) -> None:
        """The run is over (or starts again on a new pool): free what the pool holds outside this process."""

    def hosted(self) -> list:
        """Per runtime the clients it hosts (``client.Hosted``): the rows of a checkpoint each one loads."""
        return [rt.hosted() for rt in self.runtimes]


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
            atomic_write(self._file(j), codec.encode("store", old.state()))
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
