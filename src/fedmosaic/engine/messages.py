"""Messages and what each side does to them: the client ids a message is about and parts put in (architecture,
client id) order, a client's row of a message, the sub-request of some clients, replies merged, and the bytes a
round moves (``traffic``). Shared by the server, the pools and a deployment."""

from __future__ import annotations

import numpy as np
import torch

from ..protocol import codec
from ..protocol.algorithm import Algorithm
from ..protocol.tree import nbytes, take, tmap


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


def ids_of(message: dict) -> np.ndarray:
    """The client ids a message is about (``ids``: an int64 tensor), as an array."""
    return message["ids"].cpu().numpy()


def order_parts(parts: list[dict]) -> list[dict]:
    """Stacked parts of several runtimes' answers (each with client ``ids``, and an architecture ``arch`` if it
    has one) as one part per architecture, rows in (architecture, client id) order — the order a single runtime
    hosting them all answers in."""
    out = []
    for arch in sorted({p.get("arch") for p in parts}, key=lambda a: -1 if a is None else a):
        mine = [p for p in parts if p.get("arch") == arch]
        if len(mine) == 1 and bool((mine[0]["ids"][1:] > mine[0]["ids"][:-1]).all()):
            out.append(mine[0])  # one part, in order already: itself, not a copy
            continue
        ids = torch.cat([p["ids"] for p in mine])
        order = torch.argsort(ids, stable=True)
        merged = {k: tmap(lambda *ts, order=order: torch.cat(ts)[order.to(ts[0].device)], *[p[k] for p in mine])
                  for k in mine[0] if k != "arch"}
        out.append(merged if arch is None else {"arch": arch, **merged})
    return out


