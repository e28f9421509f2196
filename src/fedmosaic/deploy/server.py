"""The ServerApp: the run's server runtime and round loop (``engine.runner``), its clients on Flower SuperNodes.

:class:`FlowerPool` is a client pool (``engine.pools``) whose clients are nodes: each action goes to the clients
it concerns as one message per client, and their answers come back through the SuperLink. First contact
(``hello``) maps every client id to the node that hosts it: it asks the nodes the SuperLink lists online, and
accepts a node for client k only if its registered public key is the one ``fedmosaic deploy`` made for client k
(``node_keys.json``) and its data are the partition the server computed; a listed node that does not answer is
skipped with a line, not waited for. Every request carries a fresh nonce, and every reply passes the same checks
before any of it is used — the nonce of its request, the right client and round, a size below
``deploy.max_reply_mb``, a well-formed message, the layout (keys, shapes, dtypes) the server's own runtime of that
architecture produces for the same request, finite numbers, the sample count the server expects
(``_sample_bounds``) — and a reply that fails one is logged and left out, like a node that did not answer in time.
A round goes on with the clients that answered when at least ``deploy.min_clients`` did (``deploy`` in the round's
metrics says who), else the run stops in one line that says how to resume it.

What the server can verify, and what not: who a node is (its key), that a reply answers this request (a replayed
or re-stamped reply carries another nonce), its shape, finiteness and sample counts. It cannot verify that a node
trained honestly or evaluated honestly: a node running other code can send any well-formed update (robust
aggregation is the defence) and can report its own test hits as it likes within its split's size. So every
evaluation measured on the nodes is marked client-reported (``deploy_eval.client_reported``); the global model's
accuracy on the server's test set is the server's own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from ..config import short_repr
from ..engine.messages import (
    ids_of,
    merge_evaluations,
    merge_logits,
    order_parts,
    row,
    sub_request,
    upload_of,
)
from ..errors import CorruptDataError, FedMosaicError, RunError, one_line
from ..protocol import codec
from ..protocol.tree import all_finite, layout, leaves, to
from .common import FRESH, MESSAGE_TYPES, RECORD, check_deployable, flower, public_hash, rows_hash

#: how often the server looks for replies
POLL_S = 0.2


class Rejected(Exception):
    """A reply that is not used (the reason, one line)."""


class FlowerPool:
    """The clients of ``fed`` (a ``Federation``), one per Flower node. ``token``: the run's name on the nodes (their
    state files); ``resume``: the command that resumes this run, for the error that stops it."""

    remote = True  # the clients' state stays on their nodes: a checkpoint keeps only each one's stamp

    def __init__(self, grid, fed, token: str, resume: str, keys: dict[int, str] | None = None):
        flower()
        check_deployable(fed.cfg, type(fed.algo))
        self.grid, self.fed, self.algo, self.device = grid, fed, fed.algo, fed.device
        self.opts, self.token, self.resume = fed.cfg.deploy, token, resume
        self.num_clients = fed.num_clients
        #: per client the stamp of the state its node holds for it: the round of the last state-changing message
        #: the server accepted (-1: warmed up; FRESH: none yet)
        self.stamps = np.full(self.num_clients, FRESH, dtype=np.int64)
        self._notes: dict = {}
        self._probes: dict = {}  # architecture -> a runtime of one of its clients: the reference for replies
        self._layouts: dict = {}
        self._nonces: dict = {}  # (client or node) -> the nonce of the request it is answering now
        #: per client the public key (SubjectPublicKeyInfo PEM) of the one node that may host it; None: any
        self.keys = keys
        self.node_of = self._hello()

    # ---- first contact ------------------------------------------------------------------------------
    def _hello(self) -> dict[int, int]:
        """A node per client: the nodes the SuperLink lists online are asked which client they host; each claim is
        checked (key, data), and asking goes on until every client has its node or ``deploy.connect_timeout_s``.
        A node whose claim fails is left out (one line says why), so one registered node cannot stop a run whose
        clients all have their rightful nodes; once every node online has answered and a client is still without
        one, the refusals are why, and the run stops with them."""
        K, wait = self.num_clients, self.opts.connect_timeout_s
        deadline = time.monotonic() + wait
        node_of: dict[int, int] = {}
        asked: set[int] = set()
        silent: dict[int, float] = {}  # node -> when it was asked
        refused: dict[int, str] = {}  # node -> why its claim failed
        while len(node_of) < K:
            online = self._online()
            new = [n for n in online if n not in asked]
            if new:
                self._push("hello", 0, {n: None for n in new}, by_node=True, timeout=wait)
                asked.update(new)
                silent.update({n: time.monotonic() for n in new})
            for r in self._pull():
                nid = r.metadata.src_node_id
                if nid in silent:
                    del silent[nid]
                    try:
                        node_of[self._claim(nid, r, node_of)] = nid
                    except FedMosaicError as e:
                        refused[nid] = one_line(e)  # (what a node sent, folded to one line)
                        print(f"fedmosaic: {refused[nid]}: node {nid} left out", flush=True)
            if len(node_of) == K:
                break
            missing = sorted(set(range(K)) - set(node_of))
            if refused and not silent and set(self._online()) <= asked:
                raise FedMosaicError(f"clients {missing} have no node: " + "; ".join(refused.values()))
            if time.monotonic() > deadline:
                quiet = f"; listed online but silent: nodes {sorted(silent)}" if silent else ""
                why = "".join(f"; {w}" for w in refused.values())
                raise FedMosaicError(f"clients {missing} have no node after {wait:g} s (deploy.connect_timeout_s): "
                                     f"{len(online)} nodes online{quiet}{why}; start one SuperNode per client with "
                                     "--node-config 'partition-id=K' and its own key")
            time.sleep(POLL_S)
        for nid in sorted(silent):  # (a node the SuperLink still lists but that died: not waited for)
            print(f"fedmosaic: node {nid} is listed online but did not answer the first contact: skipped", flush=True)
        self._waiting = set()  # (their hellos' answers, should they come, are not read)
        return node_of

    def _online(self) -> list[int]:
        return sorted(self.grid.get_node_ids())

    def _key_of(self, nid: int) -> str | None:
        """The public key the SuperLink registered for node ``nid`` (PEM), or None if it does not say."""
        for info in self.grid.get_nodes() if hasattr(self.grid, "get_nodes") else ():
            if getattr(info, "node_id", None) == nid:
                key = getattr(info, "public_key", None)
                return key.decode() if isinstance(key, bytes) else key
        return None

    def _claim(self, nid: int, reply, node_of: dict) -> int:
        """The client node ``nid`` hosts, if its reply to the first contact checks out; else one line."""
        K = self.num_clients
        try:
            rec = self._record(reply)
            self._check_nonce(nid, rec)
        except Rejected as e:
            raise FedMosaicError(f"node {nid} answered the first contact with no usable reply: {e}") from None
        if "error" in rec:
            raise FedMosaicError(f"node {nid} refused the first contact: {one_line(rec['error'], 300)}")
        k = rec.get("client")
        if not isinstance(k, int) or not 0 <= k < K:
            raise FedMosaicError(f"node {nid} claims client {short_repr(k)}; the partition has clients 0-{K - 1}")
        if self.keys is not None:  # (first: a node with another's key is an impostor, whoever claimed first)
            key = self._key_of(nid)
            if key is None or _pem(key) != _pem(self.keys[k]):
                raise FedMosaicError(f"node {nid} claims client {k}, but its key is not the one made for client {k} "
                                     f"(node_keys.json): start client {k}'s SuperNode with pki/node-{k}")
        if k in node_of:
            raise FedMosaicError(f"nodes {node_of[k]} and {nid} both claim client {k} (partition-id): give "
                                 "each node its own")
        sizes = self.fed.split["train"].sizes
        ours = rows_hash(self.fed, k)
        if rec.get("rows") != ours or rec.get("train") != int(sizes[k]):
            raise FedMosaicError(
                f"node {nid} (client {k}) holds another partition: its rows hash {short_repr(rec.get('rows'), 16)} and "
                f"{short_repr(rec.get('train'))} train samples, the server's {ours[:12]} and {int(sizes[k])} (the "
                "same config, data and seed on both sides give the same partition: check the node's data-dir)")
        if rec.get("public") != public_hash(self.fed):
            raise FedMosaicError(f"node {nid} (client {k}) has another public stream than the server (data.public:"
                                 " the same dataset, or noise from the same seed, on every node)")
        if rec.get("arch") != int(self.fed.group_of[k]):
            raise FedMosaicError(f"node {nid} (client {k}) builds architecture {short_repr(rec.get('arch'))}, the server "
                                 f"{int(self.fed.group_of[k])}: another config on that node?")
        return k

    # ---- messages -----------------------------------------------------------------------------------
    def _push(self, action: str, t: int, bodies: dict, by_node: bool = False, timeout: float | None = None) -> None:
        """One message per client (``by_node``: per node id) with its body and a fresh nonce."""
        timeout = self.opts.round_timeout_s if timeout is None else timeout
        from flwr.app import ConfigRecord, Message, RecordDict

        msgs = []
        for key, body in bodies.items():
            self._nonces[key] = nonce = secrets.token_hex(16)
            rec = ConfigRecord({"action": action, "token": self.token, "round": int(t), "nonce": nonce,
                                "stamp": FRESH if by_node else int(self.stamps[key]),
                                "body": codec.encode(action, body)})
            msgs.append(Message(content=RecordDict({RECORD: rec}), dst_node_id=key if by_node else self.node_of[key],
                                message_type=MESSAGE_TYPES[action], group_id=str(t), ttl=timeout + 30))
        self._waiting = getattr(self, "_waiting", set()) | set(self.grid.push_messages(msgs))

    def _pull(self) -> list:
        got = list(self.grid.pull_messages(self._waiting)) if self._waiting else []
        self._waiting -= {r.metadata.reply_to_message_id for r in got}
        return got

    def _send(self, action: str, t: int, bodies: dict, timeout: float | None = None) -> dict:
        """One message per client with its body; the replies that came back in time, by client. Waits at most
        ``timeout`` (default ``deploy.round_timeout_s``) seconds. (Flower's ``Grid.send_and_receive`` does the same
        but looks for replies every 3 s; a round has up to four exchanges.)"""
        timeout = self.opts.round_timeout_s if timeout is None else timeout
        self._waiting = set()
        self._push(action, t, bodies, timeout=timeout)
        client_of = {n: k for k, n in self.node_of.items()}
        deadline, out = time.monotonic() + timeout, {}
        while self._waiting:
            for r in self._pull():
                key = client_of.get(r.metadata.src_node_id)
                if key in bodies and key not in out:
                    out[key] = r
            if not self._waiting or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        return out

    def _check_nonce(self, key: int, rec: dict) -> None:
        if rec.get("nonce") != self._nonces.get(key):
            raise Rejected("it does not answer this request (another request's nonce: a replayed or re-stamped "
                           "reply)")

    @staticmethod
    def _record(reply) -> dict:
        if reply.has_error():
            raise Rejected(f"Flower error {short_repr(reply.error.code)}: {one_line(reply.error.reason, 300)}")
        try:
            return dict(reply.content[RECORD])
        except (KeyError, TypeError, ValueError):
            raise Rejected(f"no {RECORD!r} record in the reply") from None

    def _ask(self, action: str, t: int, bodies: dict[int, dict], reference, check=None) -> dict[int, object]:
        """Send each client its body; the replies that pass every check (:meth:`_accept`, then ``check(client,
        body)``), by client. Fewer than ``deploy.min_clients`` of them (default: every client asked) stops the run."""
        replies = self._send(action, t, bodies)
        got, rejected = {}, {}
        for k, r in replies.items():
            try:
                got[k] = self._accept(action, t, k, r, reference)
                if check is not None:
                    check(k, got[k])
            except Exception as e:
                got.pop(k, None)
                if not isinstance(e, Rejected):
                    e = Rejected(f"unreadable ({type(e).__name__}: {e})")
                rejected[k] = str(e)
                warnings.warn(f"round {t}: {action} reply of client {k} (node {self.node_of[k]}) rejected: {e}",
                              stacklevel=2)
        missing = sorted(set(bodies) - set(replies))
        note: dict = {"asked": len(bodies), "answered": len(got)}
        if missing:
            note["missing"] = missing
        if rejected:
            note["rejected"] = {str(k): why for k, why in sorted(rejected.items())}
        self._notes[action] = note
        need = min(self.opts.min_clients or len(bodies), len(bodies))
        if len(got) < need:
            why = "; ".join([*(f"client {k}: {w}" for k, w in sorted(rejected.items())),
                             *([f"no reply from {missing} within {self.opts.round_timeout_s:g} s"] if missing else [])])
            raise RunError(f"round {t}: {len(got)} of {len(bodies)} clients answered '{action}', fewer than "
                           f"deploy.min_clients = {need} ({why}); {self._after(t)}")
        return got

    def _accept(self, action: str, t: int, k: int, reply, reference) -> object:
        """The body of client ``k``'s reply, if it passes every check; else :class:`Rejected`."""
        rec = self._record(reply)
        self._check_nonce(k, rec)
        if "error" in rec:
            raise Rejected(f"the node failed: {one_line(rec['error'], 300)}")
        if rec.get("client") != k or rec.get("round") != t:
            raise Rejected(f"it answers for client {short_repr(rec.get('client'))}, round {short_repr(rec.get('round'))}")
        data = rec.get("body")
        if not isinstance(data, bytes):
            raise Rejected("it has no message body")
        if len(data) > self.opts.max_reply_mb * 2**20:
            raise Rejected(f"{len(data) / 2**20:.1f} MiB, more than deploy.max_reply_mb = {self.opts.max_reply_mb:g}")
        want = reference(k)  # (before decoding: no honest reply is much larger than the server's own runtime's)
        if len(data) > (bound := 4 * sum(v.nbytes for v in leaves(want) if isinstance(v, torch.Tensor)) + 2**20):
            raise Rejected(f"{len(data) / 2**20:.1f} MiB, more than {bound / 2**20:.1f} MiB (four times what a client "
                           "of its architecture answers, and 1 MiB)")
        try:
            _, body = codec.decode(data, action)
        except CorruptDataError as e:
            raise Rejected(str(e)) from None
        if action == "train":  # an upload as it travels (Algorithm.pack_upload) -> its fixed shapes
            _cut_from(body, want)
            try:
                body = self._unpacked(body)
            except (ValueError, KeyError, TypeError, AttributeError, IndexError, RuntimeError) as e:
                raise Rejected(f"its upload cannot be unpacked: {str(e)[:200]}") from None
        if want is None:
            if body is not None:
                raise Rejected("an acknowledgement with a body")
            return None
        if not isinstance(body, dict) or list(layout(_no_terms(body))) != list(layout(_no_terms(want))):
            raise Rejected("its keys, shapes or dtypes are not those this request gets from a client of its "
                           "architecture")
        if action == "train" and not _named_scalars(body.get("terms")):
            raise Rejected("its objective's terms are not named numbers of its one client")
        if not all_finite(body):
            raise Rejected("NaN or infinite values")
        body = to(body, self.device)
        if "ids" in body and not bool((body["ids"] == k).all()):
            raise Rejected(f"it reports client ids {body['ids'].tolist()}")
        if "arch" in body and not bool((torch.as_tensor(body["arch"]) == int(self.fed.group_of[k])).all()):
            raise Rejected(f"it reports architecture {body['arch']}")
        return body

    # ---- references: what a client of each architecture answers ------------------------------------------
    def _probe(self, k: int):
        """A runtime on the server of one client of ``k``'s architecture (its first), and that client's id."""
        arch = int(self.fed.group_of[k])
        if arch not in self._probes:
            first = int(np.flatnonzero(self.fed.group_of == arch)[0])
            self._probes[arch] = (self.fed.client_runtime([first]), first)
        return self._probes[arch]

    def _reference(self, key, k: int, make):
        """The reply a client of ``k``'s architecture gives (``make(runtime, its client)``), computed once per
        ``key`` and architecture on a server-side runtime: what every reply's layout is checked against."""
        arch = int(self.fed.group_of[k])
        if (key, arch) not in self._layouts:
            rt, first = self._probe(k)
            self._layouts[key, arch] = make(rt, first)
        return self._layouts[key, arch]

    def _pack(self, broadcast: dict) -> dict:
        return {**broadcast, "payload": self.algo.pack_broadcast(broadcast["payload"])}

    def _own(self, first: int) -> dict:
        return self.fed.srv.assign(np.array([first]))

    # ---- the actions --------------------------------------------------------------------------------
    def warm_up(self, lr: float, assignment: dict) -> None:
        bodies = {int(k): {"lr": lr, "assignment": row(assignment, i)} for i, k in enumerate(ids_of(assignment))}
        for k in self._ask("warm_up", 0, bodies, lambda k: None):
            self.stamps[k] = -1

    def public_logits(self, broadcast: dict, assignment: dict, round_idx: int) -> dict:
        packed = self._pack(broadcast)
        bodies = {int(k): {"broadcast": packed, "assignment": row(assignment, i)}
                  for i, k in enumerate(ids_of(assignment))}

        def make(rt, first):
            return row(rt.public_logits(broadcast, self._own(first)), 0)

        got = self._ask("logits", round_idx, bodies, lambda k: self._reference("logits", k, make))
        return merge_logits([got[k] for k in sorted(got)])

    def train(self, header: dict, broadcast: dict, assignment: dict) -> list[dict]:
        t, packed = header["round"], self._pack(broadcast)
        bodies = {int(k): {"header": header, "broadcast": packed, "assignment": row(assignment, i)}
                  for i, k in enumerate(ids_of(assignment))}

        def make(rt, first):
            (part,) = rt.train(header, broadcast, self._own(first))
            return self._unpacked(upload_of(rt.algo, part, 0))

        low, high = self._sample_bounds(t)

        def check(k, body):
            n = float(body["n"].sum())
            if not (low[k] <= n <= high[k] and n.is_integer()) or bool((body["steps"] < 0).any()):
                raise Rejected(f"its sample count {short_repr(n)} is not in [{low[k]}, {high[k]}] "
                               "or its steps are negative")

        got = self._ask("train", t, bodies, lambda k: self._reference(("train", header["stage"]), k, make), check)
        for k in got:
            self.stamps[k] = t
        print(f"fedmosaic: round {t}: {len(got)} of {len(bodies)} clients trained", flush=True)  # the run's log
        parts = order_parts([_no_terms(got[k]) for k in sorted(got)])
        for p in parts:  # (the terms by name: a node may report others than its peers, not crash the merge)
            mine = [got[k]["terms"] for k in sorted(got) if got[k].get("arch") == p.get("arch")]
            p["terms"] = {n: torch.cat([m[n] for m in mine if n in m]) for n in dict.fromkeys(n for m in mine for n in m)}
        return parts

    def _sample_bounds(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Per client the sample counts an honest node can report in round ``t``: exactly its split (or its current
        task's part of it, which the server computes too), plus at most its exemplar memory's budget, whose samples
        only the node knows. A count is a client's weight in every weighted rule, so a node must not inflate it."""
        every = np.arange(self.num_clients)
        low = self.fed.train_split(t, memory=False).counts(every)
        mem = self.fed.cfg.exemplar_memory()
        if mem is None:
            return low, low
        met = (np.asarray(self.fed.label_counts) > 0).sum(1)
        room = np.full_like(low, mem.total) if mem.total is not None else mem.per_class * met
        return low, np.minimum(low + room, self.fed.split["train"].sizes)

    def _unpacked(self, msg: dict) -> dict:
        return {**msg, "upload": self.algo.unpack_upload(msg["upload"])}

    def end_task(self, header: dict, payload: dict, assignment: dict, model) -> None:
        bodies = {int(k): {"header": header, "payload": payload, "assignment": row(assignment, i), "model": model}
                  for i, k in enumerate(ids_of(assignment))}
        for k in self._ask("end_task", header["round"], bodies, lambda k: None):
            self.stamps[k] = header["round"]

    def evaluate(self, request: dict) -> dict:
        t, assignment = request["round"], request["assignment"]
        ids = ids_of(assignment)
        subs = {int(k): sub_request(request, row(assignment, i), np.array([k])) for i, k in enumerate(ids)}

        made: dict = {}  # per architecture, this request's reference reply

        def reference(k):
            rt, first = self._probe(k)
            if first not in made:
                made[first] = rt.evaluate(sub_request(request, self._own(first), np.array([first])))
            return made[first]

        got = self._ask("evaluate", t, subs, reference, self._check_counts)
        self._notes["evaluate"]["client_reported"] = sorted(  # measured on the nodes: what they say (docstring)
            k for k in ("global_clients", "global_val", "personal", "personal_val", "continual", "report")
            if request.get(k) is not None and request.get(k) is not False)
        if request.get("continual") is not None and len(got) < len(subs):
            raise RunError(f"round {t}: the continual accuracy of personal models needs every client's answer; "
                           f"{len(subs) - len(got)} missing; {self._after(t)}")
        return merge_evaluations(request, [(got[k], subs[k]) for k in sorted(got)])

    def _check_counts(self, k: int, body: dict) -> None:
        """An evaluation reply counts only its own client's samples, at most its split's size: a node cannot claim
        samples it does not hold or move another client's numbers. Within its own split it reports what it likes:
        these metrics are client-reported (``notes``)."""
        own = np.arange(self.num_clients) == k
        for split in ("test", "val"):
            if not np.array_equal(body["sizes"][split].cpu().numpy(), np.where(own, self.fed.split[split].sizes, 0)):
                raise Rejected(f"it reports other {split} split sizes than the client's partition has")
        for key, split in (("global_clients", "test"), ("global_val", "val"), ("personal", "test"),
                           ("personal_val", "val")):
            if key in body:
                c = body[key].cpu().numpy()
                if (c < 0).any() or (c > np.where(own, self.fed.split[split].sizes, 0)).any():
                    raise Rejected(f"it reports impossible counts for {key}")
        if "continual" in body and not bool(((body["continual"] == 0) | (body["continual"] == 1)).all()):
            raise Rejected("its continual hits are not 0 or 1")

    def _after(self, t: int) -> str:
        """What the operator can do once the run stops in round ``t``: resume it, or — stopped in round 0, when
        the runner keeps nothing — start it again."""
        if t == 0:
            return "no round was kept: start the run again as before (flwr run), after fixing its nodes"
        return f"resume: {self.resume}"

    # ---- checkpoints and records --------------------------------------------------------------------
    def state(self) -> dict:
        """The clients' part of a checkpoint: each one's stamp (its state stays on its node)."""
        return {"stamps": torch.as_tensor(self.stamps)}

    def load(self, state: dict) -> None:
        stamps = state["stamps"].cpu().numpy()
        if stamps.shape != (self.num_clients,):
            raise ValueError("written for another number of clients")
        self.stamps = stamps.astype(np.int64)

    def notes(self) -> dict:
        """``deploy``: per action of the round (or evaluation) the clients asked and answered, and who did not
        answer in time (``missing``) or whose reply was rejected, and why."""
        notes, self._notes = self._notes, {}
        return {"deploy": notes} if notes else {}

    def close(self) -> None:
        """Nothing to free: the nodes keep their clients' state (and the run may resume on them)."""

    def meta(self) -> dict:
        out = {"driver": "flower", "token": self.token,
               "nodes": {str(k): int(n) for k, n in sorted(self.node_of.items())}}
        if self.keys is not None:  # which key hosts which client (SHA-256 of its PEM), kept with the run
            out["node_keys"] = {str(k): hashlib.sha256(_pem(v).encode()).hexdigest()[:16]
                                for k, v in sorted(self.keys.items())}
        return out


def _pem(key: str) -> str:
    """A PEM key without its line breaks and surrounding blanks (the SuperLink's and ours may wrap alike or not)."""
    return "".join(str(key).split())


def read_keys(path: Path, clients: int) -> dict[int, str]:
    """``node_keys.json``: per client the PEM public key of the node that may host it (``fedmosaic deploy``)."""
    try:
        raw = json.loads(path.read_text())
        keys = {int(k): str(v) for k, v in raw.items()}
    except FileNotFoundError:
        raise FedMosaicError(f"{path.name}: not beside the app's run.yaml; a deployment made by `fedmosaic deploy` "
                             "binds each client to its node's key there") from None
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise FedMosaicError(f"{path}: unreadable ({type(e).__name__})") from None
    if sorted(keys) != list(range(clients)) or not all("PUBLIC KEY" in v for v in keys.values()):
        raise FedMosaicError(f"{path}: needs one public key per client 0-{clients - 1}")
    return keys


def _named_scalars(terms) -> bool:
    """A train reply's ``terms`` (which :func:`_no_terms` leaves out of the layout check): at most 32 names of at
    most 64 printable characters, each with one float for the reply's one client."""
    return isinstance(terms, dict) and len(terms) <= 32 and all(
        isinstance(n, str) and 0 < len(n) <= 64 and n.isprintable() and isinstance(v, torch.Tensor)
        and v.is_floating_point() and tuple(v.shape) == (1,) for n, v in terms.items())


def _cut_from(body, want: dict) -> None:
    """A packed upload is cut from the fixed shapes of its reference, never grown: every tensor at a path the
    reference has, of its rank and dtype and no dimension larger — checked before unpacking, which pads (FedKD's
    widths, whose bound a node would otherwise set itself: 900 bytes asking for gigabytes)."""
    ref = {p: (s, d) for p, s, d in layout(want.get("upload") if isinstance(want, dict) else None, "/upload")}
    got = body.get("upload") if isinstance(body, dict) else None
    for p, s, d in layout(got, "/upload"):
        if d is None:  # (a number or a name: unpack_upload judges it)
            continue
        r = ref.get(p)
        if r is None or r[1] != d or len(s) != len(r[0]) or any(a > b for a, b in zip(s, r[0], strict=True)):
            raise Rejected(f"its upload's {p[:80]!r} of shape {list(s)[:8]} is not cut from the reference's "
                           f"{list(r[0]) if r else None}")


def _no_terms(body: dict) -> dict:
    """A reply without the names of its objective's terms (which may change with the round's program)."""
    return {k: v for k, v in body.items() if k != "terms"} if isinstance(body, dict) else body


def server_app(config_path: str | Path):
    """The ServerApp of a deployment whose config is ``config_path`` (the app's ``run.yaml``). Run config keys:
    ``run-dir`` (where the run directory is, or goes), ``resume``, ``data-dir`` (the server's data search path),
    ``resume-command`` (said by the error that stops a run)."""
    fl = flower()
    app = fl.serverapp.ServerApp()
    logging.getLogger("flwr").addFilter(_one_line_refusals)

    @app.main()
    def main(grid, context) -> None:
        from .. import plugins
        from ..config import load_config
        from ..paths import set_data_dirs
        from ..runs.runner import run

        rc = context.run_config
        before = set_data_dirs(str(rc["data-dir"])) if rc.get("data-dir") else False  # for this run only
        try:
            plugins.load()  # datasets and models of $FEDMOSAIC_PLUGINS and installed entry points
            cfg = load_config(Path(config_path))
            out, resume = Path(str(rc["run-dir"])), bool(rc.get("resume", False))
            token = _token(out) if resume else secrets.token_hex(12)
            hint = str(rc.get("resume-command") or "flwr run APP SUPERLINK --run-config 'resume=true'")
            keys = read_keys(Path(config_path).with_name("node_keys.json"), cfg.data.clients or 0)
            summary = run(cfg, out, resume=resume, progress=False,
                          pool=lambda fed: FlowerPool(grid, fed, token, hint, keys))
        finally:
            if before is not False:
                set_data_dirs(before)
        print(json.dumps({"run_dir": str(out), "summary": summary}), flush=True)

    return app


def _one_line_refusals(record: logging.LogRecord) -> bool:
    """Flower logs a failed ServerApp with its traceback (``flwr run --stream`` shows it): a refusal of ours is one
    line, as everywhere else; anything else keeps its traceback (a bug must be reportable)."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, FedMosaicError):
        record.msg, record.args = f"fedmosaic: error: {one_line(str(exc), 2000)}", ()
        record.exc_info = record.exc_text = None
    return True


def _token(out: Path) -> str:
    """The node token of the run in ``out`` (its ``meta.json``): a resumed run finds its clients' state under it."""
    try:
        token = json.loads((out / "meta.json").read_text())["token"]
    except (OSError, ValueError, KeyError, TypeError):
        raise FedMosaicError(f"resume: {out} is not a deployed run (no node token in its meta.json)") from None
    if not isinstance(token, str) or not token.isalnum():
        raise FedMosaicError(f"resume: {out}/meta.json has a damaged node token")
    return token
