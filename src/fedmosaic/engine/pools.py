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

import numpy as np
import torch

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


def merge_evaluations(request: dict, replies: list[tuple[dict, dict]]) -> dict:
    """One EvalReply to ``request`` from (reply, the sub-request it answers) of several runtimes: per-client counts
    added up (each runtime has zeros for the clients it does not host), continual hits back in the request's order
    of clients, the reports in client order."""
    out: dict = {}
    hits, at = [], []
    order = {} if request.get("continual") is None else {
        int(k): i for i, k in enumerate(ids_of(request["continual"]))}
    for reply, sub in replies:
        for k, v in reply.items():
            if k == "continual":
                hits.append(v)
                at.append([order[int(c)] for c in ids_of(sub["continual"])])
            elif k == "report":
                out.setdefault(k, []).append(v)
            else:
                out[k] = tmap(torch.add, out[k], v) if k in out else v
    if hits:
        out["continual"] = torch.cat(hits)[torch.as_tensor(np.argsort(np.concatenate(at), kind="stable"))]
    if "report" in out:
        (out["report"],) = order_parts(out["report"])
    return out


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
    client's test split in one place: a simulation-only measurement, refused before a wire pool is built.)"""

    def __init__(self, runtimes: list[ClientRuntime], algo, device: torch.device):
        self.runtimes, self.algo, self.device = runtimes, algo, device
        self.traffic: dict[str, list[int]] = {}

    notes, meta, hosted, close = InProcessPool.notes, InProcessPool.meta, InProcessPool.hosted, InProcessPool.close

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
        for rt in self.runtimes:
            mine = rows_of(assignment, rt.clients)
            if mine is not None:
                yield rt, mine

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
        asked = [(sub_request(request, mine, rt.clients), rt) for rt, mine in self._each(request["assignment"])]
        return merge_evaluations(request, [(self._call(rt, "evaluate", sub), sub) for sub, rt in asked])

    def state(self) -> list[dict]:
        return [self._call(rt, "state") for rt in self.runtimes]

    def load(self, parts: list[dict]) -> None:
        for rt, part in zip(self.runtimes, parts, strict=True):
            self._call(rt, "load", part)
