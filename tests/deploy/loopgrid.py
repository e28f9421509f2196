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

    def __init__(self, config_path, clients: int, state_dir, tamper=None, node_config=None):
        self.config_path, self.tamper, self.down = config_path, tamper, set()
        self.nodes = {1000 + k: SimpleNamespace(
            node_config={"partition-id": k, "state-dir": str(state_dir), **(node_config or {}).get(k, {})},
            state=RecordDict()) for k in range(clients)}
        self.sent: list = []
        # what a Flower run sets in its ServerApp process: Message() needs it
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1

    def get_node_ids(self):
        return [n for n in self.nodes if n not in self.down]

    def push_messages(self, messages):
        self.replies = {}
        for i, m in enumerate(messages):
            reply = self._answer(m)
            if reply is not None:
                reply.metadata.reply_to_message_id = i
                self.replies[i] = reply
        return list(range(len(messages)))

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]

    def _answer(self, m):
        self.sent.append(m)
        nid = m.metadata.dst_node_id
        if nid in self.down:
            return None
        try:
            rec = answer(self.config_path, m.content[RECORD], self.nodes[nid])
        except Exception as e:
            rec = {"error": f"{type(e).__name__}: {e}"}
        if self.tamper is not None:
            rec = self.tamper(nid - 1000, m.content[RECORD]["action"], dict(rec))
            if rec is None:  # dropped: as if the node had not answered
                return None
        return SimpleNamespace(has_error=lambda: False, content=RecordDict({RECORD: ConfigRecord(rec)}),
                               metadata=SimpleNamespace(src_node_id=nid))
