"""A Flower Grid stand-in that hands each message to ``deploy.node.answer`` in this process: the server pool's
logic (first contact, checks, stamps) tested in milliseconds. The real SuperLink and SuperNodes run in
test_flower.py; this is not a substitute for them."""

from __future__ import annotations

from types import SimpleNamespace

from flwr.app import ConfigRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedmosaic.deploy.common import RECORD
from fedmosaic.deploy.node import answer


class LoopGrid:
    """Node ``1000 + k`` hosts client ``k`` with ``node_config[k]`` (besides its partition-id and state-dir);
    ``tamper(client, action, record)`` may rewrite a reply record (a hostile node) or drop it (None); ``down``:
    nodes that answer nothing."""

    def __init__(self, config_path, clients: int, state_dir, tamper=None, node_config=None, keys=None):
        self.config_path, self.tamper, self.down = config_path, tamper, set()
        self.keys = keys or {}  # node id -> the public key (PEM) the SuperLink registered for it
        self.silent: set = set()  # nodes listed online that never answer (dead, not yet timed out)
        self.replies, self.next_id = {}, 0
        self.nodes = {1000 + k: SimpleNamespace(
            node_config={"partition-id": k, "state-dir": str(state_dir), **(node_config or {}).get(k, {})},
            state=RecordDict()) for k in range(clients)}
        self.sent: list = []
        # what a Flower run sets in its ServerApp process: Message() needs it
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1

    def get_node_ids(self):
        return [n for n in self.nodes if n not in self.down] + sorted(self.silent)

    def get_nodes(self):
        return [SimpleNamespace(node_id=n, public_key=self.keys.get(n)) for n in self.get_node_ids()]

    def push_messages(self, messages):
        ids = []
        for m in messages:
            i, self.next_id = self.next_id, self.next_id + 1
            reply = self._answer(m)
            if reply is not None:
                reply.metadata.reply_to_message_id = i
                self.replies[i] = reply
            ids.append(i)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]

    def _answer(self, m):
        self.sent.append(m)
        nid = m.metadata.dst_node_id
        if nid in self.down or nid in self.silent:
            return None
        try:
            rec = answer(self.config_path, m.content[RECORD], self.nodes[nid])
        except Exception as e:
            rec = {"error": f"{type(e).__name__}: {e}", "nonce": m.content[RECORD]["nonce"]}
        if self.tamper is not None:
            rec = self.tamper(nid - 1000, m.content[RECORD]["action"], dict(rec))
            if rec is None:  # dropped: as if the node had not answered
                return None
        return SimpleNamespace(has_error=lambda: False, content=RecordDict({RECORD: ConfigRecord(rec)}),
                               metadata=SimpleNamespace(src_node_id=nid))
