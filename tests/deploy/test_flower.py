"""Real deployments on loopback: a Flower SuperLink with TLS and node authentication, one SuperNode per client
(``flower-supernode`` processes with registered keys), the app ``fedmosaic deploy`` writes, ``flwr run``. Each
exchange costs seconds of Flower polling and process starts, so runs are short and the tests slow-marked. (Those
that start federations of their own, to kill them, are in test_flower_recovery.py: a second file, which a second
test worker takes.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.slow

from cases import config, same_metrics
from harness import completed, deploy, finished, start
from hostile import nan_oversized_x1000
from loopgrid import LoopGrid

from fedmosaic.cli.main import main
from fedmosaic.config import dump
from fedmosaic.deploy.prepare import NODE_KEYS, node_config, node_key
from fedmosaic.deploy.server import FlowerPool
from fedmosaic.runs.records import read_metrics
from fedmosaic.runs.runner import run

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def link(tmp_path_factory):
    fed = start(tmp_path_factory.mktemp("flower"))
    yield fed
    fed.stop()



# (a real deployment costs ~5-10 s per message round here: a ClientApp process per message. FedAvg runs deployed
# end to end in the poisoned-reply, killed-node and commands.sh tests; Ditto's personal state on the nodes across
# rounds in the killed-node tests; all 14 protocol algorithms equal the simulator on the in-process grid,
# tests/deploy/test_pool.py. These two add the exchange — one round of it: warm-up, logits, train — and the task
# stream — two tasks: the second trains with the first's memory, teacher and prototypes.)
SHORT = {"ahf": {"train": {"rounds": 1}}, "protofcl": {"data": {"tasks": {"n_tasks": 2}}}}


@pytest.mark.parametrize("family", ["ahf", "protofcl"])
def test_a_deployed_run_equals_the_in_process_run(family, link, tmp_path):
    cfg = config(family, eval={"every": 2}, **SHORT[family])
    app = deploy(cfg, tmp_path / "dep", link)
    completed(link, app)
    got = read_metrics(tmp_path / "dep" / "run")
    run(cfg, tmp_path / "sim", progress=False)
    assert same_metrics(got, read_metrics(tmp_path / "sim")) == []
    meta = json.loads((tmp_path / "dep" / "run" / "meta.json").read_text())
    assert meta["driver"] == "flower" and sorted(meta["nodes"]) == ["0", "1", "2"]
    assert (tmp_path / "dep" / "run" / "summary.json").is_file()
    assert main(["report", str(tmp_path / "dep" / "run"), str(tmp_path / "sim")]) == 0  # read like any run


def test_a_poisoned_reply_is_rejected_and_the_round_is_still_right(link, tmp_path):
    """Client 2's node runs hostile code: a NaN upload in round 0, an oversized one in round 1, both rejected and
    logged (each round goes on with the others), then a finite 1000 x model in round 2, which no check can reject and
    the configured defence (aggregation: median) defeats. Every round equals the in-process run with the same
    replies (tests/deploy/test_pool.py: the same x1000 wrecks FedAvg without the defence)."""
    cfg = config("fedavg", train={"rounds": 3}, eval={"every": 3}, aggregation={"rule": "median"},
                 deploy={"min_clients": 2, "max_reply_mb": 1})
    app = deploy(cfg, tmp_path / "dep", link)
    (app / "fedmosaic_app" / "client_app.py").write_text(HOSTILE.format(tests=str(HERE)))
    st = completed(link, app)
    got = read_metrics(tmp_path / "dep" / "run")
    assert "NaN" in got[0]["deploy"]["train"]["rejected"]["2"]
    assert "MiB" in got[1]["deploy"]["train"]["rejected"]["2"]
    assert "reply of client 2 (node" in st["log"]  # logged by the server
    assert "2" not in got[2]["deploy"]["train"].get("rejected", {})  # the x1000 upload was accepted ...
    assert got[2]["global"]["loss"] < 5  # ... and defeated (undefended: ~1.5e5)
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "run.yaml").write_text(dump(cfg))
    grid = LoopGrid(tmp_path / "sim" / "run.yaml", 3, tmp_path / "sim" / "nodes", tamper=nan_oversized_x1000)
    with pytest.warns(UserWarning):
        run(cfg, tmp_path / "sim" / "run", progress=False, pool=lambda fed: FlowerPool(grid, fed, "t0k3n", "R"))
    assert same_metrics(got, read_metrics(tmp_path / "sim" / "run")) == []


HOSTILE = '''"""A hostile ClientApp: fedmosaic's, except that client 2 poisons its uploads (tests/deploy/hostile.py)."""
import sys
from pathlib import Path

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp

sys.path.insert(0, {tests!r})
from fedmosaic.deploy.common import MESSAGE_TYPES, RECORD
from fedmosaic.deploy.node import answer
from hostile import nan_oversized_x1000

app = ClientApp()


def handle(msg, context):
    rec = nan_oversized_x1000(context.node_config["partition-id"], msg.content[RECORD]["action"],
                 answer(Path(__file__).with_name("run.yaml"), msg.content[RECORD], context))
    return Message(content=RecordDict({{RECORD: ConfigRecord(rec)}}), reply_to=msg)


for mtype in MESSAGE_TYPES.values():
    category, _, action = mtype.partition(".")
    getattr(app, category)(action or "default")(handle)
'''


def test_only_the_operator_controls_the_deployment(link, tmp_path):
    """A party that holds ca.crt (every node has it) and reaches the nodes' address tries the Control API through it
    while the operator's run is on: register its own node key, start its own app, stop the run, list the runs —
    every attempt is refused at the gateway; the run completes with the simulation's numbers, the SuperLink lists
    only the operator's nodes and runs. (The run uses local DP: each node clips and noises its own upload, and the
    numbers are still the simulation's.)"""
    from harness import write_home

    cfg = config("fedavg", train={"rounds": 1}, privacy={"mode": "local", "noise": 0.3, "clip": 1.0})
    app = deploy(cfg, tmp_path / "dep", link)
    rid = link.submit(app)
    attacker = tmp_path / "attacker"
    write_home(attacker, f"127.0.0.1:{link.port}", link.pki / "ca.crt")  # the nodes' address, their CA
    node_key(attacker / "mine")
    rogue = deploy(config("fedavg", train={"rounds": 1}), tmp_path / "rogue", link)
    tries = {"register": ["supernode", "register", str(attacker / "mine.pub"), "fedmosaic", "--format", "json"],
             "run": ["run", str(rogue), "fedmosaic", "--format", "json"],
             "stop": ["stop", str(rid), "fedmosaic", "--format", "json"],
             "ls": ["ls", "fedmosaic", "--format", "json"],
             "nodes": ["supernode", "list", "fedmosaic", "--format", "json"]}
    for what, args in tries.items():
        r = link.flwr(*args, home=attacker, timeout=60)
        out = r.stdout + r.stderr
        assert r.returncode != 0 or '"success": false' in out.replace("\n", " ").lower() \
            or '"success":false' in out.replace(" ", "").lower(), f"{what} was not refused: {out[-1500:]}"
        assert str(rid) not in r.stdout or what == "stop", f"{what} leaked the operator's run: {r.stdout[-500:]}"
    st = link.wait(rid, 400, done=tmp_path / "dep" / "run" / "summary.json")
    assert st["status"] == "finished:completed", st["status-details"]
    run(cfg, tmp_path / "sim", progress=False)
    assert same_metrics(read_metrics(tmp_path / "dep" / "run"), read_metrics(tmp_path / "sim")) == []
    runs = json.loads(link.flwr("ls", "fedmosaic", "--format", "json").stdout)["runs"]
    assert str(rid) in {str(r["run-id"]) for r in runs} and len(runs) == len({r["run-id"] for r in runs})
    assert all("rogue" not in json.dumps(r) for r in runs)
    nodes = json.loads(link.flwr("supernode", "list", "fedmosaic", "--format", "json").stdout)["nodes"]
    assert len(nodes) == 3  # the operator's three; the attacker's key was never registered


def test_a_registered_node_cannot_push_an_instruction_to_another_node(link, tmp_path):
    """A node of the federation (its key registered) pushes, through the gateway and with Flower's own Fleet
    client, a message that answers nothing and names another node: the SuperLink would store it as an instruction
    for that node, whose ClientApp would run it. The gateway refuses it (403, one line); the operator's run goes on
    and equals the simulation."""
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.inflatable.inflatable_object import get_object_tree
    from flwr.supercore.run import RunNotRunningException
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.supernode.fleet_http_connection import http_request_response

    cfg = config("fedavg", train={"rounds": 1})
    app = deploy(cfg, tmp_path / "dep", link)
    rid = link.submit(app)
    node_key(tmp_path / "insider")
    link.register(tmp_path / "insider.pub")
    nodes = json.loads(link.flwr("supernode", "list", "fedmosaic", "--format", "json").stdout)["nodes"]
    key = load_ssh_private_key((tmp_path / "insider").read_bytes(), None)
    with http_request_response(f"127.0.0.1:{link.port}", False, str(link.pki / "ca.crt"), (key, key.public_key()),
                               max_retries=0, max_wait_time=30) as (me, _, send, *_):
        victim = next(int(n["node-id"]) for n in nodes if int(n["node-id"]) != me)
        before = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = rid, SUPERLINK_NODE_ID, 1  # "from" it
        try:
            forged = Message(content=RecordDict({"fedmosaic": ConfigRecord({"action": "train"})}),
                             dst_node_id=victim, message_type="train", group_id="0", ttl=600)
        finally:
            TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = before
        # Flower's client turns a 403 into RunNotRunningException (a BaseException), the gateway's answer its cause
        with pytest.raises(RunNotRunningException) as refused:
            send(forged, get_object_tree(forged), 0.0)
    answer = refused.value.__context__.response
    assert answer.status_code == 403 and "a node pushes replies only" in answer.text
    st = link.wait(rid, 400, done=tmp_path / "dep" / "run" / "summary.json")
    assert st["status"] == "finished:completed", st["status-details"]
    run(cfg, tmp_path / "sim", progress=False)
    assert same_metrics(read_metrics(tmp_path / "dep" / "run"), read_metrics(tmp_path / "sim")) == []


def test_a_registered_node_claiming_another_clients_partition_is_refused(link, tmp_path):
    """The app binds client 0 to node 1's key and client 1 to node 0's (as if node 0 claimed client 1's partition
    with its own registered key): the SuperLink's record of each node's key refuses the run at first contact."""
    cfg = config("fedavg", train={"rounds": 1})
    app = deploy(cfg, tmp_path / "dep", link)
    keys_file = app / "fedmosaic_app" / NODE_KEYS
    keys = json.loads(keys_file.read_text())
    keys["0"], keys["1"] = keys["1"], keys["0"]
    keys_file.write_text(json.dumps(keys))
    st = finished(link, app)
    assert st["status"] == "finished:failed"
    assert "claims client" in st["status-details"] and "its key is not the one made for client" in st["status-details"]
    assert "fedmosaic: error:" in st["log"] and "Traceback" not in st["log"]  # one line in the run's log, too
    assert not (tmp_path / "dep" / "run" / "metrics.jsonl").exists()


def test_an_unregistered_supernode_is_refused(link, tmp_path):
    node_key(tmp_path / "stranger")
    p = link.start_node("stranger", tmp_path / "stranger", node_config(0, tmp_path / "nodes"),
                        ["--max-retries", "1", "--max-wait-time", "20"])
    try:
        p.wait(60)
    finally:
        link.stop("stranger")
    assert p.returncode != 0
    assert "Failed to activate SuperNode" in link.log("stranger") or "2004" in link.log("stranger")
