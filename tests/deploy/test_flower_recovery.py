"""Deployments that fail and come back, each on a federation of its own on loopback (as test_flower.py's): a
node whose data differ, a SuperNode killed mid-run, everything killed mid-run."""

from __future__ import annotations

import gzip
import shutil

import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.slow

from cases import config, same_metrics
from harness import completed, deploy, finished, kill_after_round_0, patient, start, start_node

from fedmosaic.engine.runner import read_metrics, run


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
    answer. With every client required it stops in one line naming the resume command. (That a resumed run ends
    with the numbers of an uninterrupted one, nodes restarted from their state files, is the next test's.)"""
    fed = start(tmp_path / "fed")
    try:
        cfg = config("ditto", eval={"every": 2}, deploy={"round_timeout_s": patient(20), "min_clients": 2})
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
        cfg = config("ditto", eval={"every": 2}, deploy={"round_timeout_s": patient(20)})
        app = deploy(cfg, tmp_path / "b", fed)
        rid = fed.submit(app)
        kill_after_round_0(fed, rid, tmp_path / "b" / "run")
        st = fed.wait(rid, 400)
        assert st["status"] == "finished:failed"
        why = st["status-details"]
        assert "round 1: 2 of 3 clients answered 'train'" in why and "resume:" in why and "\n" not in why.strip()
    finally:
        fed.stop()


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
