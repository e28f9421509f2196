"""Replies a hostile or broken node could send: each rewrites an honest reply record of ``deploy.node.answer``."""

from __future__ import annotations

import torch

from fedmosaic.protocol import codec
from fedmosaic.protocol.tree import tmap


def _body(rec: dict, action: str, change) -> dict:
    _, body = codec.decode(rec["body"], action)
    return {**rec, "body": codec.encode(action, change(body))}


def _first_leaf(upload: dict):
    key = sorted(upload)[0]
    return (key, *_first_leaf(upload[key])) if isinstance(upload[key], dict) else (key,)


def _reshape(body: dict) -> dict:
    """The upload's first tensor one column short."""
    up, path = body["upload"], _first_leaf(body["upload"])
    node = up
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = node[path[-1]][..., :-1]
    return body


POISONS = {
    "nan": lambda rec, a: _body(rec, a, lambda b: {**b, "upload": tmap(lambda t: t * float("nan")
                                                                     if t.is_floating_point() else t, b["upload"])}),
    "inf_loss": lambda rec, a: _body(rec, a, lambda b: {**b, "loss": b["loss"] + float("inf")}),
    "shape": lambda rec, a: _body(rec, a, _reshape),
    "dtype": lambda rec, a: _body(rec, a, lambda b: {**b, "upload": tmap(lambda t: t.double(), b["upload"])}),
    "extra_key": lambda rec, a: _body(rec, a, lambda b: {**b, "extra": torch.zeros(3)}),
    "oversized": lambda rec, a: _body(rec, a, lambda b: {**b, "pad": torch.zeros(2**19)}),  # 2 MiB
    "garbage": lambda rec, a: {**rec, "body": b"FMSG" + b"\x00" * 64},
    "wrong_round": lambda rec, a: {**rec, "round": rec["round"] + 1},
    "wrong_client": lambda rec, a: {**rec, "client": (rec["client"] + 1) % 3},
    "samples": lambda rec, a: _body(rec, a, lambda b: {**b, "n": b["n"] * 1000}),
    "one_sample_more": lambda rec, a: _body(rec, a, lambda b: {**b, "n": b["n"] + 1}),  # (its weight, a little)
    "no_body": lambda rec, a: {k: v for k, v in rec.items() if k != "body"},
    "odd_types": lambda rec, a: {**rec, "round": str(rec["round"]), "body": [1, 2]},
    "terms_shape": lambda rec, a: _body(rec, a, lambda b: {**b, "terms": {n: v.repeat(5) for n, v in b["terms"].items()}
                                                              or {"ce": torch.zeros(5)}}),
    "terms_type": lambda rec, a: _body(rec, a, lambda b: {**b, "terms": [1.0, 2.0]}),
    "terms_many": lambda rec, a: _body(rec, a, lambda b: {**b, "terms": {f"t{i}": torch.zeros(1) for i in range(99)}}),
    "error_text": lambda rec, a: {"error": "\x1b[2J" + "x" * 10**6, "nonce": rec["nonce"]},
}


#: replies no check can reject: well-formed and finite (what robust aggregation is for), or client-reported
ACCEPTED = {
    "own_terms": lambda rec, a: _body(rec, a, lambda b: {**b, "terms": {"mine": torch.ones(1)}}),
    "x1000": lambda rec, a: _body(rec, a, lambda b: {**b, "upload": tmap(lambda t: t * 1000.0
                                                                       if t.is_floating_point() else t, b["upload"])}),
}


def poison_train(name: str, victim: int, rounds: set | None = None):
    """A tamper function (``LoopGrid``/the hostile ClientApp) that poisons ``victim``'s train replies (in
    ``rounds``, default every round) with ``POISONS[name]``."""
    def tamper(client: int, action: str, rec: dict) -> dict:
        if client == victim and action == "train" and "body" in rec and (rounds is None or rec["round"] in rounds):
            return {**POISONS, **ACCEPTED}[name](rec, action)
        return rec
    return tamper


def nan_oversized_x1000(client: int, action: str, rec: dict) -> dict:
    """Client 2 uploads NaN in round 0, 2 MiB too much in round 1 (both rejected) and 1000 x its model in round 2
    (finite and well-formed: accepted, for the aggregation stage to defeat)."""
    for name, t in (("nan", 0), ("oversized", 1), ("x1000", 2)):
        rec = poison_train(name, 2, {t})(client, action, rec)
    return rec
