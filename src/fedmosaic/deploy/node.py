"""The ClientApp: one client of the federation per SuperNode, on the node's own data.

Flower runs every message in a fresh process, so a message rebuilds the node's client: the run's config (shipped
in the app), its client id (``--node-config partition-id=K``), the partition of its data (``data-dir=PATH``, else
``$FEDMOSAIC_DATA``) — from which it takes its own rows — and its runtime (``engine.client.ClientRuntime``, built
as the simulator's wire pool builds it: the same numbers). Its state lives in ``Context.state`` and in a node-local
file per stamp (``state-dir=PATH``, default ``~/.fedmosaic/nodes``), so a restarted SuperNode, which loses
``Context.state``, carries on from the file. Each message names the stamp the client must start from (the round
of the last state-changing message the server accepted): a stale or missing state is an error, never used.

Every reply echoes the request's ``nonce``, so the server takes it as the answer to that request and to no other.
Every failure answers with one ``error`` line instead of a body; the server logs it and goes on without the
client.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..errors import one_line
from ..protocol import codec
from .common import FRESH, MESSAGE_TYPES, RECORD, flower, public_hash, rows_hash

#: stamps kept per client on a node: the server may resume from a checkpoint a few rounds old
KEEP_STAMPS = 64


class NodeStore:
    """One client's state on its node: ``<state-dir>/<token>/client-<k>/stamp_<s>.fmsg`` (codec messages, written
    atomically) and the newest in ``Context.state`` (with its SHA-256)."""

    def __init__(self, root: Path, token: str, client: int, context):
        if not token or not token.isalnum():
            raise ValueError(f"run token {token!r} is not alphanumeric")
        self.dir = Path(root).expanduser() / token / f"client-{client}"
        self.token, self.client, self.context = token, client, context

    def path(self, stamp: int) -> Path:
        return self.dir / f"stamp_{stamp - FRESH:08d}.fmsg"

    def read(self, stamp: int):
        rec = self.context.state.get(RECORD)
        if rec is not None and rec.get("token") == self.token and rec.get("stamp") == stamp \
                and rec.get("client") == self.client:
            data = rec["state"]
            if hashlib.sha256(data).hexdigest() != rec.get("sha256"):
                raise ValueError(f"the state of stamp {stamp} in Context.state does not match its SHA-256")
        else:
            try:
                data = self.path(stamp).read_bytes()
            except FileNotFoundError:
                raise ValueError(f"no state of stamp {stamp} on this node ({self.path(stamp)}): was it moved, or "
                                 "is this another node?") from None
        return codec.decode(data, "store")[1]

    def write(self, stamp: int, state) -> None:
        from ..files import atomic_write

        data = codec.encode("store", state)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o700)  # (a client's personal model and store: its owner's alone, whatever the umask)
        atomic_write(self.path(stamp), data)
        for old in sorted(self.dir.glob("stamp_*.fmsg"))[:-KEEP_STAMPS]:
            old.unlink(missing_ok=True)
        self.context.state[RECORD] = flower().app.ConfigRecord({
            "token": self.token, "client": self.client, "stamp": stamp, "state": data,
            "sha256": hashlib.sha256(data).hexdigest()})


def _node(config_path: Path, context):
    """(client id, the node's federation) of this message."""
    from .. import plugins
    from ..config import load_config
    from ..paths import set_data_dirs
    from ..setup.world import build_federation

    nc = context.node_config
    if "partition-id" not in nc:
        raise ValueError("this SuperNode has no partition-id: start it with --node-config 'partition-id=K'")
    client = nc["partition-id"]
    if not isinstance(client, int) or client < 0:
        raise ValueError(f"partition-id must be a client id >= 0 (got {client!r})")
    # the node's data folder holds while its federation is built (the data are read then), not for the process
    before = set_data_dirs(str(nc["data-dir"])) if nc.get("data-dir") else False
    try:
        plugins.load()  # the node's own datasets and models: $FEDMOSAIC_PLUGINS, installed entry points
        cfg = load_config(config_path)
        fed = build_federation(cfg, pool="none")  # builds no client state: the node's one client's below
    finally:
        if before is not False:
            set_data_dirs(before)
    if client >= fed.num_clients:
        raise ValueError(f"partition-id {client}: the config's partition has {fed.num_clients} clients (0-"
                         f"{fed.num_clients - 1})")
    return client, fed


def answer(config_path: Path, rec, context) -> dict:
    """The reply record to one message ``rec`` (``common.RECORD``)."""
    from ..engine.messages import row, upload_of
    from ..protocol.tree import to

    action, t = rec["action"], int(rec["round"])
    client, fed = _node(config_path, context)
    if action == "hello":
        from ..version import __version__

        return {"client": client, "round": t, "nonce": rec.get("nonce", ""), "rows": rows_hash(fed, client),
                "public": public_hash(fed), "partition": fed.fd.hash, "train": int(fed.split["train"].sizes[client]),
                "arch": int(fed.group_of[client]), "fedmosaic": __version__}
    rt = fed.client_runtime([client])
    store = NodeStore(Path(context.node_config.get("state-dir") or "~/.fedmosaic/nodes"), rec["token"], client,
                      context)
    stamp = int(rec["stamp"])
    if stamp != FRESH:
        rt.load(to(store.read(stamp), rt.device))
    _, body = codec.decode(rec["body"], action)
    body = to(body, rt.device)
    reply, new_stamp = None, None
    if action == "warm_up":
        rt.warm_up(body["lr"], body["assignment"])
        new_stamp = -1
    elif action == "logits":
        bc = body["broadcast"]
        reply = row(rt.public_logits({**bc, "payload": rt.algo.unpack_broadcast(bc["payload"])}, body["assignment"]), 0)
    elif action == "train":
        bc = body["broadcast"]
        (part,) = rt.train(body["header"], {**bc, "payload": rt.algo.unpack_broadcast(bc["payload"])},
                           body["assignment"])
        reply, new_stamp = upload_of(rt.algo, part, 0), t
    elif action == "end_task":
        rt.end_task(body["header"], body["payload"], body["assignment"], body["model"])
        new_stamp = t
    elif action == "evaluate":
        reply = rt.evaluate(body)
    else:
        raise ValueError(f"unknown action {action!r}")
    if new_stamp is not None:
        store.write(new_stamp, rt.state())
    return {"client": client, "round": t, "nonce": rec.get("nonce", ""), "body": codec.encode(action, reply)}


def client_app(config_path: str | Path):
    """The ClientApp of a deployment whose config is ``config_path`` (the app's ``run.yaml``)."""
    fl = flower()
    from flwr.app import ConfigRecord, Message, RecordDict

    app = fl.clientapp.ClientApp()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

    def handle(msg, context):
        try:
            reply = answer(Path(config_path), msg.content[RECORD], context)
        except Exception as e:
            reply = {"error": one_line(f"{type(e).__name__}: {e}", 2000),
                     "nonce": str(msg.content[RECORD].get("nonce", "")) if RECORD in msg.content else ""}
        return Message(content=RecordDict({RECORD: ConfigRecord(reply)}), reply_to=msg)

    for mtype in MESSAGE_TYPES.values():
        category, _, action = mtype.partition(".")
        getattr(app, category)(action or "default")(handle)
    return app
