"""Real deployments on loopback: a Flower SuperLink with TLS and node authentication, one SuperNode per client
(``flower-supernode`` processes with registered keys), the app ``fedmosaic deploy`` writes, ``flwr run``. Each
exchange costs seconds of Flower polling and process starts, so runs are short and the tests slow-marked."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.slow

from cases import config, same_metrics
from harness import LocalFederation
from hostile import nan_then_oversized
from loopgrid import LoopGrid

from fedmosaic.cli.main import main
from fedmosaic.config import dump
from fedmosaic.deploy.prepare import NODE_KEYS, make_pki, node_config, node_key, prepare, public_key_pem
from fedmosaic.deploy.server import FlowerPool
from fedmosaic.engine.runner import read_metrics, run

HERE = Path(__file__).resolve().parent


def start(root: Path, clients: int = 3, data: dict | None = None) -> LocalFederation:
    """A SuperLink and ``clients`` registered SuperNodes (``data[k]``: node k's data-dir), all online."""
    from conftest import DATA_PATH

    make_pki(root / "pki", ["127.0.0.1"], clients)
    fed = LocalFederation(root, root / "pki", os.environ.get("FEDMOSAIC_TEST_DATA", DATA_PATH))
    try:
        fed.start_link()
        for k in range(clients):
            fed.register(root / "pki" / f"node-{k}.pub")
            start_node(fed, k, (data or {}).get(k))
        fed.wait_online(clients)
    except BaseException:
        fed.stop()
        raise
    return fed


def start_node(fed: LocalFederation, k: int, data_dir: str | None = None):
    return fed.start_node(f"node{k}", fed.pki / f"node-{k}", node_config(k, fed.root / "nodes", data_dir))


@pytest.fixture(scope="module")
def link(tmp_path_factory):
    fed = start(tmp_path_factory.mktemp("flower"))
    yield fed
    fed.stop()


def deploy(cfg, where: Path, fed: LocalFederation) -> Path:
    """The app of ``cfg`` (its commands name other ports: the tests' federation has its own), its clients bound to
    the node keys of ``fed``'s PKI, as `fedmosaic deploy` binds them to the keys it makes."""
    prepare(cfg, where, port=1, link_port=2, check=False)
    keys = {str(k): public_key_pem(fed.pki / f"node-{k}.pub") for k in range(cfg.data.clients)}
    (where / "app" / "fedmosaic_app" / NODE_KEYS).write_text(json.dumps(keys))
    return where / "app"


def finished(fed: LocalFederation, app: Path, run_config: str | None = None, timeout: float = 400) -> dict:
    st = fed.wait(fed.submit(app, run_config), timeout)
    st["log"] = fed.logs_of(int(st["run-id"]))
    return st


def completed(fed, app, run_config=None) -> dict:
    st = finished(fed, app, run_config)
    assert st["status"] == "finished:completed", f"{st['status-details']}\n{st['log'][-4000:]}"
    return st


# (a real deployment costs ~80-160 s here. FedAvg runs deployed end to end in the poisoned-reply, killed-node and
# commands.sh tests; Ditto's personal state on the nodes takes ProtoFCL's path; all 14 protocol algorithms equal the
# simulator on the in-process grid, tests/deploy/test_pool.py. These two add the exchange and the task stream.)
@pytest.mark.parametrize("family", ["ahf", "protofcl"])
def test_a_deployed_run_equals_the_in_process_run(family, link, tmp_path):
    cfg = config(family, eval={"every": 2})
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
    """Client 2's node runs hostile code: a NaN upload in round 0, an oversized one in round 1. Both are rejected
    and logged; each round goes on with the others and equals the in-process run with the same replies."""
    cfg = config("fedavg", eval={"every": 2}, deploy={"min_clients": 2, "max_reply_mb": 1})
    app = deploy(cfg, tmp_path / "dep", link)
    (app / "fedmosaic_app" / "client_app.py").write_text(HOSTILE.format(tests=str(HERE)))
    st = completed(link, app)
    got = read_metrics(tmp_path / "dep" / "run")
    assert "NaN" in got[0]["deploy"]["train"]["rejected"]["2"]
    assert "MiB" in got[1]["deploy"]["train"]["rejected"]["2"]
    assert "reply of client 2 (node" in st["log"]  # logged by the server
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "run.yaml").write_text(dump(cfg))
    grid = LoopGrid(tmp_path / "sim" / "run.yaml", 3, tmp_path / "sim" / "nodes", tamper=nan_then_oversized)
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
from hostile import nan_then_oversized

app = ClientApp()


def handle(msg, context):
    rec = nan_then_oversized(context.node_config["partition-id"], msg.content[RECORD]["action"],
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
    only the operator's nodes and runs."""
    from harness import write_home

    cfg = config("fedavg", train={"rounds": 1})
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
    st = link.wait(rid, 400)
    assert st["status"] == "finished:completed", st["status-details"]
    run(cfg, tmp_path / "sim", progress=False)
    assert same_metrics(read_metrics(tmp_path / "dep" / "run"), read_metrics(tmp_path / "sim")) == []
    runs = json.loads(link.flwr("ls", "fedmosaic", "--format", "json").stdout)["runs"]
    assert str(rid) in {str(r["run-id"]) for r in runs} and len(runs) == len({r["run-id"] for r in runs})
    assert all("rogue" not in json.dumps(r) for r in runs)
    nodes = json.loads(link.flwr("supernode", "list", "fedmosaic", "--format", "json").stdout)["nodes"]
    assert len(nodes) == 3  # the operator's three; the attacker's key was never registered


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


def test_a_node_with_another_partition_is_refused_at_first_contact(tmp_path):
    """Node 1's copy of USPS differs (one pixel of every image): the server refuses it before round 0."""
    from conftest import need_data

    need_data("usps")
    from fedmosaic.data.registry import find_layout, get_spec

    _, folder = find_layout(get_spec("usps"))
    other = tmp_path / "other" / "usps"
    shutil.copytree(folder, other)
    lines = gzip.open(other / "zip.train.gz", "rt").read().splitlines()
    with gzip.open(other / "zip.train.gz", "wt") as f:
        f.write("\n".join(" ".join([*ln.split()[:1], "0.5", *ln.split()[2:]]) for ln in lines) + "\n")
    fed = start(tmp_path / "fed", data={1: str(tmp_path / "other")})
    try:
        cfg = config("fedavg", data={"dataset": "usps"}, train={"rounds": 1})
        st = finished(fed, deploy(cfg, tmp_path / "dep", fed))
    finally:
        fed.stop()
    assert st["status"] == "finished:failed"
    assert "client 1) holds another partition" in st["status-details"]
    assert not (tmp_path / "dep" / "run" / "metrics.jsonl").exists()


def test_a_supernode_killed_mid_run(tmp_path):
    """Node 2 is killed while round 1 runs. With min_clients 2 the run finishes on the others, saying who did not
    answer. With every client required it stops in one line naming the resume command; node 2 restarts (its state
    file is all it has) and the resumed run ends with the numbers of an uninterrupted one."""
    fed = start(tmp_path / "fed")
    try:
        cfg = config("ditto", eval={"every": 2}, deploy={"round_timeout_s": 20, "min_clients": 2})
        app = deploy(cfg, tmp_path / "a", fed)
        rid = fed.submit(app)
        kill_after_round_0(fed, rid, tmp_path / "a" / "run")
        st = fed.wait(rid, 400)
        assert st["status"] == "finished:completed", st["status-details"]
        got = read_metrics(tmp_path / "a" / "run")
        assert [r["deploy"]["train"].get("missing") for r in got] == [None, [2]]
        assert got[1]["deploy_eval"]["evaluate"]["missing"] == [2]
        assert got[1]["personal"]["clients"] == 2

        start_node(fed, 2)
        fed.wait_online(3)
        cfg = config("ditto", eval={"every": 2}, deploy={"round_timeout_s": 20})
        app = deploy(cfg, tmp_path / "b", fed)
        rid = fed.submit(app)
        kill_after_round_0(fed, rid, tmp_path / "b" / "run")
        st = fed.wait(rid, 400)
        assert st["status"] == "finished:failed"
        why = st["status-details"]
        assert "round 1: 2 of 3 clients answered 'train'" in why and "resume:" in why and "\n" not in why.strip()
        start_node(fed, 2)
        fed.wait_online(3)
        completed(fed, app, "resume=true")
    finally:
        fed.stop()
    run(cfg, tmp_path / "sim", progress=False)
    assert same_metrics(read_metrics(tmp_path / "b" / "run"), read_metrics(tmp_path / "sim")) == []


def test_everything_killed_mid_run_comes_back_in_the_documented_order_and_resumes_exactly(tmp_path):
    """kill -9 of the SuperLink (with its ServerApp), the gateway and every SuperNode while round 1 runs; then the
    order commands.sh documents — SuperLink, gateway, keys registered, SuperNodes (at once: no waiting for the old
    ones to time out), `resume=true` — ends with the metrics of a run that was never interrupted."""
    fed = start(tmp_path / "fed")
    try:
        cfg = config("ditto", eval={"every": 1}, train={"rounds": 3})
        app = deploy(cfg, tmp_path / "a", fed)
        rid = fed.submit(app)
        kill_after_round_0(fed, rid, tmp_path / "a" / "run", kill=fed.kill_all)
        fed.start_link()
        for k in range(3):
            fed.register(fed.pki / f"node-{k}.pub")
            start_node(fed, k)
        fed.wait_online(3)
        completed(fed, app, "resume=true")
    finally:
        fed.stop()
    run(cfg, tmp_path / "sim", progress=False)
    assert same_metrics(read_metrics(tmp_path / "a" / "run"), read_metrics(tmp_path / "sim")) == []


def kill_after_round_0(fed: LocalFederation, run_id: int, run_dir: Path, timeout: float = 300, kill=None) -> None:
    deadline, polls = time.monotonic() + timeout, 0
    while not (run_dir / "metrics.jsonl").is_file() or not read_metrics(run_dir):
        assert time.monotonic() < deadline, "round 0 did not finish"
        polls += 1
        if polls % 25 == 0:  # a run that ended before its first round: say why
            st = fed.status(run_id)
            assert not st["status"].startswith("finished"), f"{st['status-details']}\n{fed.logs_of(run_id)[-3000:]}"
        time.sleep(0.2)
    kill() if kill else fed.stop("node2")
