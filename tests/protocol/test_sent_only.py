"""Client hooks see what was sent: evaluating and training with the broadcast passed through the codec (bytes and
back) gives the numbers of the live broadcast, for the algorithms whose clients read the server's trees (APFL-PD's
refresh flag, pFedSRB's and FedPAC's global model, FedWeIT's knowledge base, FedProto's and ProtoFCL's prototypes)."""

from __future__ import annotations

import pytest
from fedtest import BLOBS6, assert_trees_close, with_overrides

from fedmosaic.engine.federation import Federation
from fedmosaic.protocol import codec
from fedmosaic.protocol.tree import to
from fedmosaic.setup.world import build_federation

CONTINUAL = {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"}, "client_test": 0.0,
             "tasks": {"n_tasks": 5, "rounds_per_task": 1, "memory": {"per_class": 2}}}
CASES = [({"name": "apfl_pd", "z": 1}, None), ({"name": "pfedsrb"}, None), ({"name": "fedpac"}, None),
         ({"name": "fedala"}, None), ({"name": "fedproto"}, None), ({"name": "fedweit"}, CONTINUAL),
         ({"name": "protofcl"}, CONTINUAL)]


def federation(algo: dict, data: dict | None, wire: bool) -> Federation:
    raw = {**BLOBS6, "algorithm": algo, "train": {**BLOBS6["train"], "rounds": 3}}
    if data is not None:
        raw |= {"data": data, "eval": {"client_test": False}}
    fed = build_federation(with_overrides(raw))
    if wire:  # every broadcast crosses as bytes
        live = fed.algo.broadcast
        fed.algo.broadcast = lambda server, t: to(codec.decode(codec.encode("broadcast", live(server, t)))[1],
                                                  fed.device)  # as a pool puts what it receives
    return fed


@pytest.mark.parametrize("algo, data", CASES, ids=[c[0]["name"] for c in CASES])
def test_what_was_sent_is_enough(algo, data):
    live, wire = federation(algo, data, False), federation(algo, data, True)
    for t in range(3):
        live.round(t), wire.round(t)
        assert live.evaluate(t) == wire.evaluate(t)
    assert_trees_close(live.state_dict(), wire.state_dict(), exact=True)
