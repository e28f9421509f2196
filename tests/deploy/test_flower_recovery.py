"""Deployments that fail and come back, on federations of their own on loopback (as test_flower.py's): a node whose
data differ and a SuperNode killed mid-run on one (node 1 holds an altered USPS; digits are built in, the same on
every node), everything killed mid-run on another."""

from __future__ import annotations

import gzip
import os
import shutil

import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.slow

from cases import config, same_metrics
from harness import completed, deploy, finished, kill_after_round_0, patient, start, start_node

from fedmosaic.runs.records import read_metrics
from fedmosaic.runs.runner import run


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    """A federation whose node 1 holds a copy of USPS with one pixel of every image changed."""
    from conftest import DATA_PATH, need_data

    from fedmosaic.data.registry import find_layout, get_spec

    with pytest.MonkeyPatch.context() as mp:  # (the tests' data search path: a module's fixture runs before theirs)
        mp.setenv("FEDMOSAIC_DATA", os.environ.get("FEDMOSAIC_TEST_DATA", DATA_PATH))
        need_data("usps")
        _, folder = find_layout(get_spec("usps"))
    root = tmp_path_factory.mktemp("recovery")
    other = root / "other" / "usps"
    shutil.copytree(folder, other)
    lines = gzip.open(other / "zip.train.gz", "rt").read().splitlines()
    with gzip.open(other / "zip.train.gz", "wt") as f:
        f.write("\n".join(" ".join([*ln.split()[:1], "0.5", *ln.split()[2:]]) for ln in lines) + "\n")
    fed = start(root / "fed", data={1: str(root / "other")})
    yield fed
    fed.stop()


def test_a_node_with_another_partition_is_refused_at_first_contact(fed, tmp_path):
    """Node 1's copy of USPS differs (one pixel of every image): the server refuses it before round 0."""
    cfg = config("fedavg", data={"dataset": "usps"}, train={"rounds": 1})
    st = finished(fed, deploy(cfg, tmp_path / "dep", fed))
    assert st["status"] == "finished:failed"
    assert "client 1) holds another partition" in st["status-details"]
    assert not (tmp_path / "dep" / "run" / "metrics.jsonl").exists()


def test_a_supernode_killed_mid_run(fed, tmp_path):
    """Node 2 is killed while round 1 runs. With min_clients 2 the run finishes on the others, saying who did not
    answer. (With every client required the run stops in one line naming the resume command: the same server code
    on the in-process grid, tests/deploy/test_pool.py, and a failed run's one line reaches Flower's status as
    test_flower.py's refused-partition run shows. That a resumed run ends with the numbers of an uninterrupted one,
    nodes restarted from their state files, is the next test's.)"""
    cfg = config("ditto", eval={"every": 2}, deploy={"round_timeout_s": patient(20), "min_clients": 2})
    app = deploy(cfg, tmp_path / "a", fed)
    rid = fed.submit(app)
    try:
        kill_after_round_0(fed, rid, tmp_path / "a" / "run")
        st = fed.wait(rid, 400, done=tmp_path / "a" / "run" / "summary.json")
    finally:
        start_node(fed, 2)  # (the module's federation whole again)
    assert st["status"] == "finished:completed", st["status-details"]
    got = read_metrics(tmp_path / "a" / "run")
    assert [r["deploy"]["train"].get("missing") for r in got] == [None, [2]]
    assert got[1]["deploy_eval"]["evaluate"]["missing"] == [2]
    assert got[1]["personal"]["clients"] == 2


def test_everything_killed_mid_run_comes_back_in_the_documented_order_and_resumes_exactly(tmp_path):
    """kill -9 of the SuperLink (with its ServerApp), the gateway and every SuperNode while round 1 runs; then the
    order commands.sh documents — SuperLink, gateway, keys registered, SuperNodes (at once: no waiting for the old
    ones to time out), `resume=true` — ends with the metrics of a run that was never interrupted."""
    fed = start(tmp_path / "fed", clients=2)  # (two nodes: a third would add processes, not a case)
    try:
        # two rounds: killed in round 1, resumed from round 0's checkpoint
        cfg = config("ditto", eval={"every": 2}, data={"clients": 2}, train={"clients_per_round": 2})
        app = deploy(cfg, tmp_path / "a", fed)
        rid = fed.submit(app)
        kill_after_round_0(fed, rid, tmp_path / "a" / "run", kill=fed.kill_all)
        fed.start_link()
        for k in range(2):
            fed.register(fed.pki / f"node-{k}.pub")
            start_node(fed, k)
        fed.wait_online(2)
        completed(fed, app, "resume=true")
    finally:
        fed.stop()
    run(cfg, tmp_path / "sim", progress=False)
    assert same_metrics(read_metrics(tmp_path / "a" / "run"), read_metrics(tmp_path / "sim")) == []
