"""Client pools: where the server's messages go and where the clients' answers come from.

A pool offers the client actions of a round — ``warm_up``, ``public_logits``, ``train``, ``end_task``,
``evaluate`` — over the clients it hosts, and the clients' part of a checkpoint. The server side
(``federation.Federation``) drives every round through one, and never touches a client's data or store itself.

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
from ..protocol.tree import take, tmap
from .client import ClientRuntime, NonFiniteLoss, ids_of


def order_parts(parts: list[dict]) -> list[dict]:
    """Upload parts of several runtimes as one part per architecture, in (architecture, client id) order — the
    order a single runtime hosting them all answers in."""
    out = []
    for arch in sorted({p["arch"] for p in parts}):
        mine = [p for p in parts if p["arch"] == arch]
        if len(mine) == 1 and bool((mine[0]["ids"][1:] > mine[0]["ids"][:-1]).all()):
            out.append(mine[0])  # one part, in order already: itself, not a copy
            continue
        ids = torch.cat([p["ids"] for p in mine])
        order = torch.argsort(ids, stable=True)
        merged = {k: tmap(lambda *ts: torch.cat(ts)[order.to(ts[0].device)], *[p[k] for p in mine])
                  for k in mine[0] if k != "arch"}
        out.append({"arch": arch, **merged})
    return out


class InProcessPool:
    """Every client in one runtime: the messages go in and out as they are — no copies, no codec."""

    def __init__(self, runtime: ClientRuntime):
        self.runtime = runtime
        self.runtimes = [runtime]

    def warm_up(self, lr: float, assignment: dict) -> None:
        self.runtime.warm_up(lr, assignment)

    def public_logits(self, payload: dict, assignment: dict) -> dict:
        return self.runtime.public_logits(payload, assignment)

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


class WirePool:
    """Each runtime hosts its own clients; every message to it and every answer from it travels as bytes through
    the codec (``protocol.codec``), and ``sent``/``received`` count those bytes. The server's broadcast goes to each
    runtime once; each gets only its own clients' rows of an assignment. The K x K cross matrix needs every
    client's test split in one place: a simulation-only measurement, refused here."""

    def __init__(self, runtimes: list[ClientRuntime], device: torch.device):
        self.runtimes, self.device = runtimes, device
        self.sent = self.received = 0

    def _wire(self, kind: str, body, device: torch.device):
        data = codec.encode(kind, body)
        _, out = codec.decode(data, kind)
        return data, tmap(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, out)

    def _call(self, rt: ClientRuntime, action: str, *args):
        data, args = self._wire(action, list(args), rt.device)
        self.sent += len(data)
        reply = getattr(rt, action)(*args)
        if reply is None:
            return None
        data, reply = self._wire(f"{action}-reply", reply, self.device)
        self.received += len(data)
        return reply

    def _mine(self, rt: ClientRuntime, assignment: dict) -> dict | None:
        """``rt``'s clients' rows of an assignment (None: none of them is in it)."""
        ids = ids_of(assignment)
        hosted = np.flatnonzero(np.isin(ids, rt.clients))
        if not len(hosted):
            return None
        return take(assignment, torch.as_tensor(hosted))

    def _each(self, assignment: dict):
        for rt in self.runtimes:
            mine = self._mine(rt, assignment)
            if mine is not None:
                yield rt, mine

    def warm_up(self, lr: float, assignment: dict) -> None:
        for rt, mine in self._each(assignment):
            self._call(rt, "warm_up", lr, mine)

    def public_logits(self, payload: dict, assignment: dict) -> dict:
        replies = [self._call(rt, "public_logits", payload, mine) for rt, mine in self._each(assignment)]
        parts = order_parts([{"arch": arch, "ids": r["ids"][r["arch"] == arch], "logits": r["logits"][r["arch"] == arch]}
                             for r in replies for arch in r["arch"].unique().tolist()])
        return {"ids": torch.cat([p["ids"] for p in parts]), "arch": torch.cat([torch.full_like(p["ids"], p["arch"])
                                                                               for p in parts]),
                "logits": torch.cat([p["logits"] for p in parts])}

    def train(self, header: dict, broadcast: dict, assignment: dict) -> list[dict]:
        parts, failed = [], []
        for rt, mine in self._each(assignment):
            try:
                parts += self._call(rt, "train", header, broadcast, mine)
            except NonFiniteLoss:
                failed += ids_of(mine).tolist()
        if failed:
            raise NonFiniteLoss(f"round {header['round']}: non-finite loss or update on clients {failed[:10]}")
        return order_parts(parts)

    def end_task(self, header: dict, payload: dict, assignment: dict, model) -> None:
        for rt, mine in self._each(assignment):
            self._call(rt, "end_task", header, payload, mine, model)

    def evaluate(self, request: dict) -> dict:
        if request.get("cross"):
            raise ValueError("eval.cross_clients: the K x K matrix is measured in simulation only (every client's "
                             "test split in one process), not over the wire")
        out: dict = {}
        continual = request.get("continual")
        order = None if continual is None else {int(k): i for i, k in enumerate(ids_of(continual))}
        hits, at = [], []
        for rt, mine in self._each(request["assignment"]):
            sub = {**request, "assignment": mine}
            if continual is not None:
                pos = np.array([order[int(k)] for k in rt.clients])
                sub["continual"] = {**continual, "ids": continual["ids"][pos], "rows": continual["rows"][pos]}
                at.append(pos)
            reply = self._call(rt, "evaluate", sub)
            for k, v in reply.items():
                if k == "continual":
                    hits.append(v)
                elif k == "report":
                    out.setdefault(k, []).append(v)
                else:
                    out[k] = out[k] + v if k in out else v
        if hits:
            out["continual"] = torch.cat(hits)[torch.as_tensor(np.argsort(np.concatenate(at), kind="stable"))]
        if "report" in out:
            reports = out["report"]
            ids = torch.cat([r["ids"] for r in reports])
            order_ = torch.argsort(ids, stable=True)
            out["report"] = {"ids": ids[order_], "reports": tmap(lambda *ts: torch.cat(ts)[order_],
                                                                 *[r["reports"] for r in reports])}
        return out

    def state(self) -> list[dict]:
        return [self._call(rt, "state") for rt in self.runtimes]

    def load(self, parts: list[dict]) -> None:
        for rt, part in zip(self.runtimes, parts, strict=True):
            self._call(rt, "load", part)
