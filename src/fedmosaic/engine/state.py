"""The checkpoint format of a federation: the server's part and the clients' parts keyed by client id, collected
from whichever pool hosts them (any pool resumes any checkpoint), and format 1 upgraded."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CorruptDataError
from ..protocol.tree import take
from .client.runtime import Hosted
from .messages import ids_of, order_parts

#: The checkpoint layout: 2 = the server's part and the clients' parts keyed by client id (format 1, before the
#: server/client split: per architecture group its store and a (buffers, server buffers, task buffers) triple).
FORMAT = 2


def state_dict(fed) -> dict:
    """A checkpoint: the server's part (its state, BatchNorm statistics and learning-rate plateau) and the
    clients' (collected from the pool) — per architecture its clients' ``ids`` and their store and buffers
    stacked in that order, and per client id its exemplar memory. Which pool wrote it, and how it sharded the
    clients, leaves no trace: any pool resumes it."""
    if getattr(fed.pool, "remote", False):  # the clients' state stays on their nodes: the pool's record of it
        return {"format": FORMAT, "server": fed.server,
                "server_buffers": [g.global_buffers for g in fed.groups], "plateau": dict(fed.plateau),
                "server_opt": fed.srv.opt_state, "dp_clip": fed.srv.dp_clip, "clients": fed.pool.state(),
                "memory": None}
    parts = fed.pool.state()
    clients, memory = [], [None] * fed.num_clients
    for g in fed.groups:
        (mine,) = order_parts([p for part in parts for p in part["groups"] if p["arch"] == g.gid])
        clients.append(mine)
    for part in parts:
        for k, m in zip(np.concatenate([ids_of(p) for p in part["groups"]]), part["memory"] or []):
            memory[k] = m
    return {"format": FORMAT, "server": fed.server, "server_buffers": [g.global_buffers for g in fed.groups],
            "plateau": dict(fed.plateau), "server_opt": fed.srv.opt_state, "dp_clip": fed.srv.dp_clip,
            "clients": clients,
            "memory": None if fed.exemplars is None else memory}


def upgrade(fed, state: dict) -> dict:
    """A checkpoint in today's layout: format 2 as it is; format 1 (no ``format``: written before the
    server/client split) converted, its groups' clients being this run's. Anything else: ValueError."""
    fmt = state.get("format", 1)
    if fmt == FORMAT:
        return state
    if fmt != 1 or "stores" not in state:
        raise ValueError(f"checkpoint format {fmt}; this fedmosaic reads formats 1 and {FORMAT}")
    # Checkpoints written before BatchNorm support carry no "buffers"; that is only equivalent when the model
    # has none.
    buffers = state.get("buffers")
    if buffers is None:
        if any(g.buffers or g.global_buffers for g in fed.groups):
            raise CorruptDataError("checkpoint has no BatchNorm statistics but the model has buffers; "
                                   "it was written for a different model")
        buffers = [({}, {}, {})] * len(fed.groups)
    if len(state["stores"]) != len(fed.groups) or len(buffers) != len(fed.groups):
        raise ValueError("written for another number of architectures")
    if any(not tb and b for b, _, *tb in buffers):  # written before teachers had statistics of their own
        raise CorruptDataError("checkpoint has no teacher BatchNorm statistics; it was written by an older "
                               "fedmosaic")
    clients = [{"arch": g.gid, "ids": torch.as_tensor(g.clients), "store": s, "buffers": b,
                "task_buffers": tb[0] if tb else {}}
               for g, s, (b, _, *tb) in zip(fed.groups, state["stores"], buffers, strict=True)]
    old = {k: v for k, v in state.items() if k not in ("stores", "buffers")}
    return {**old, "format": FORMAT, "server_buffers": [gb for _, gb, *_ in buffers], "clients": clients}


def load_state_dict(fed, state: dict) -> None:
    """Resume from a checkpoint of either format, into whichever pool this run has."""
    state = upgrade(fed, state)
    if getattr(fed.pool, "remote", False):
        fed.pool.load(state["clients"])
        fed.server, fed.plateau = state["server"], dict(state.get("plateau", fed.plateau))
        fed.srv.opt_state, fed.srv.dp_clip = state.get("server_opt"), state.get("dp_clip")
        for g, gb in zip(fed.groups, state["server_buffers"], strict=True):
            g.global_buffers = gb
        return
    if fed.exemplars is not None and (state.get("memory") is None or len(state["memory"]) != fed.num_clients):
        raise ValueError("written without this run's exemplar memory")  # (before anything is replaced)
    clients = state["clients"]
    if len(clients) != len(fed.groups) or any(
            c["arch"] != g.gid or not np.array_equal(ids_of(c), g.clients)
            for c, g in zip(clients, fed.groups, strict=False)):
        raise ValueError("written for another assignment of clients to architectures")
    fed.server = state["server"]
    fed.plateau = dict(state.get("plateau", fed.plateau))
    fed.srv.opt_state, fed.srv.dp_clip = state.get("server_opt"), state.get("dp_clip")
    for g, gb in zip(fed.groups, state["server_buffers"], strict=True):
        g.global_buffers = gb
    fed.pool.load([client_part(fed, h, clients, state.get("memory")) for h in fed.pool.hosted()])


def client_part(fed, hosted: Hosted, clients: list[dict], memory: list | None) -> dict:
    """A runtime's rows of a checkpoint's client parts (the same tensors when it hosts every client)."""
    groups = []
    for gid, ids in hosted.groups:
        full = clients[fed.srv.group_index[gid]]
        trees = [full[k] for k in ("store", "buffers", "task_buffers")]
        if not np.array_equal(ids_of(full), ids):
            at = torch.as_tensor(np.searchsorted(ids_of(full), ids))
            trees = [take(tr, at) for tr in trees]
        store, bufs, task = trees
        groups.append({"arch": gid, "ids": torch.as_tensor(ids), "store": store, "buffers": bufs,
                       "task_buffers": task})
    return {"groups": groups, "memory": [memory[k] for k in hosted.clients] if hosted.memory else None}
