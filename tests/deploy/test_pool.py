"""The deployment's server pool and node handler, wired through an in-process grid (``loopgrid``): the same numbers
as the simulator, every hostile reply rejected with the effect of no reply, first contact refusing what does not
belong, resume from the nodes' state files. (test_flower.py runs the same against a real SuperLink.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("flwr")

import cases
from cases import same_metrics
from hostile import POISONS, poison_train
from loopgrid import LoopGrid

from fedmosaic.config import dump
from fedmosaic.deploy.common import check_deployable
from fedmosaic.deploy.server import FlowerPool
from fedmosaic.errors import ConfigError, FedMosaicError, RunError
from fedmosaic.protocol.algorithm import registered
from fedmosaic.runs.records import read_metrics
from fedmosaic.runs.runner import run


def config(family: str = "fedavg", **over):
    """``cases.config``, waiting a moment for a reply (the loop grid answers at once or never)."""
    return cases.config(family, **{**over, "deploy": {"round_timeout_s": 0.3, **over.get("deploy", {})}})


def sub(path, name):
    (path / name).mkdir()
    return path / name


def deployed(cfg, tmp_path, name="dep", grid=None, **kw):
    """Run ``cfg`` through a loop grid (or ``grid``) with its nodes' files in ``tmp_path``; (its metrics, the
    grid)."""
    (tmp_path / "run.yaml").write_text(dump(cfg))
    grid = grid or LoopGrid(tmp_path / "run.yaml", cfg.data.clients, tmp_path / "nodes", **kw)
    run(cfg, tmp_path / name, progress=False, pool=lambda fed: FlowerPool(grid, fed, "t0k3n", "RESUME"))
    return read_metrics(tmp_path / name), grid


def simulated(cfg, tmp_path, name="sim"):
    run(cfg, tmp_path / name, progress=False)
    return read_metrics(tmp_path / name)


@pytest.mark.parametrize("family", ["fedavg", "ditto", "ahf", "protofcl", *(
    pytest.param(a, marks=pytest.mark.slow) for a in cases.PROTOCOL if a not in ("fedavg", "ditto", "ahf", "protofcl"))])
def test_deployed_pool_equals_the_simulator(family, tmp_path):
    cfg = config(family)
    got, grid = deployed(cfg, tmp_path)
    assert same_metrics(got, simulated(cfg, tmp_path), tol=0) == []
    assert all(r["deploy"]["train"] == {"asked": 3, "answered": 3} for r in got)
    assert grid.sent, "nothing went through the grid"


def test_a_report_between_evaluations_asks_the_nodes_and_notes_its_own_round(tmp_path):
    """eval.report_every: the rounds between evaluations ask every node for its report alone — the same numbers
    as the simulator's, and each round's notes say who answered that round's request, not the next's."""
    cfg = config("protofcl", data={"tasks": {"rounds_per_task": 2}}, train={"rounds": 6},
                 eval={"every": 3, "report_every": 1})
    got, _ = deployed(cfg, tmp_path)
    assert same_metrics(got, simulated(cfg, tmp_path), tol=0) == []
    assert all("proto_inter" in r["report"] for r in got)
    between = [r for r in got if "continual" not in r]
    assert between and all(r["deploy_eval"]["evaluate"]["client_reported"] == ["report"] for r in between)
    assert all("evaluate" not in r["deploy"] for r in got)  # no request's notes carried into the next round


@pytest.mark.parametrize("family", ["fedavg", "ditto"])
def test_deployed_pool_equals_the_simulator_on_the_vectorized_backend(family, tmp_path):
    """Each node vmaps over its one client, the simulator over the cohort: the same numbers up to float rounding."""
    cfg = config(family, engine={"backend": "vectorized"})
    got, _ = deployed(cfg, tmp_path)
    assert same_metrics(got, simulated(cfg, tmp_path), tol=1e-6) == []


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_poisoned_reply_is_rejected_and_counts_as_no_reply(poison, tmp_path):
    """Client 2 poisons its round-0 upload: the round goes on with the others (min_clients 2), the reason is in
    the metrics, and every number equals the run where client 2 sent nothing in round 0."""
    cfg = config("fedavg", deploy={"min_clients": 2, "max_reply_mb": 1})
    with pytest.warns(UserWarning, match="reply of client 2 .* rejected"):
        got, _ = deployed(cfg, sub(tmp_path, "bad"), "bad", tamper=poison_train(poison, 2, {0}))
    silent, _ = deployed(cfg, sub(tmp_path, "silent"), "silent",
                         tamper=lambda k, a, rec: None if (k, a, rec.get("round")) == (2, "train", 0) else rec)
    assert list(got[0]["deploy"]["train"]["rejected"]) == ["2"]
    why = got[0]["deploy"]["train"]["rejected"]["2"]
    assert len(why) < 500 and why.isprintable(), why[:100]  # (a node's own text: one bounded line, no escapes)
    assert got[0]["deploy"]["train"]["answered"] == 2 and got[0]["clients"] == 2
    assert same_metrics(got, silent, tol=0) == []
    assert got[1]["deploy"]["train"] == {"asked": 3, "answered": 3}  # trusted again in round 1, from its old state


def test_a_finite_x1000_upload_is_accepted_and_the_configured_defence_defeats_it(tmp_path):
    """A node running other code may send any finite update for its own client (README, "who can do what"):
    client 2's 1000 x model passes every check and wrecks FedAvg's global model; with aggregation: median the run
    stays within a few points of the honest one — the same stage as in a simulation (issue 38)."""
    cfg = lambda **agg: config("fedavg", train={"rounds": 4}, **agg)  # noqa: E731
    honest, _ = deployed(cfg(), sub(tmp_path, "honest"), "r")
    attacked, _ = deployed(cfg(), sub(tmp_path, "none"), "r", tamper=poison_train("x1000", 2))
    defended, _ = deployed(cfg(aggregation={"rule": "median"}), sub(tmp_path, "median"), "r",
                           tamper=poison_train("x1000", 2))
    assert all("rejected" not in r["deploy"]["train"] for r in attacked)  # finite and well-formed: accepted
    loss = [r[-1]["train_loss"] for r in (honest, attacked, defended)]  # the clients' loss from the global model
    acc = [r[-1]["global_clients"]["acc"] for r in (honest, attacked, defended)]
    assert loss[1] > 1e6 and loss[2] < 1.5 * loss[0] and acc[1] < acc[2], (loss, acc)  # (median of 3 non-IID
    # clients is a coarser mean than FedAvg's: 0.60 against 0.81 after 4 rounds, the attacked run 0.47)


def test_a_rejected_reply_says_why(tmp_path):
    cfg = config("fedavg", deploy={"min_clients": 1, "max_reply_mb": 1}, train={"rounds": 1})
    why = {}
    for name in ("nan", "shape", "oversized", "garbage", "wrong_round"):
        with pytest.warns(UserWarning):
            got, _ = deployed(cfg, sub(tmp_path, name), "r",
                              tamper=poison_train(name, 1))
        why[name] = got[0]["deploy"]["train"]["rejected"]["1"]
    assert "NaN" in why["nan"] and "shapes" in why["shape"] and "MiB" in why["oversized"]
    assert "malformed message" in why["garbage"]
    assert "round" in why["wrong_round"]
    assert all("\n" not in w for w in why.values())


def test_an_evaluation_that_counts_more_than_its_client_has_is_rejected(tmp_path):
    from hostile import _body

    cfg = config("ditto", deploy={"min_clients": 2}, train={"rounds": 1})

    def inflate(k, action, rec):
        if (k, action) == (1, "evaluate") and "body" in rec:
            return _body(rec, action, lambda b: {**b, "personal": b["personal"] * 3 + 1})
        return rec

    with pytest.warns(UserWarning, match="evaluate reply of client 1 .* rejected"):
        got, _ = deployed(cfg, sub(tmp_path, "bad"), "bad", tamper=inflate)
    silent, _ = deployed(cfg, sub(tmp_path, "silent"), "silent",
                         tamper=lambda k, a, rec: None if (k, a) == (1, "evaluate") else rec)
    assert "impossible counts for personal" in got[0]["deploy_eval"]["evaluate"]["rejected"]["1"]
    assert "personal" in got[0]["deploy_eval"]["evaluate"]["client_reported"]  # what nodes say of themselves
    assert got[0]["personal"]["clients"] == 2
    assert same_metrics(got, silent, tol=0) == []


@pytest.mark.parametrize("memory", [None, {"per_class": 2}])
def test_a_task_stream_node_claiming_its_whole_split_is_rejected(memory, tmp_path):
    """In a task stream an honest node counts its current task (and its exemplar memory): a node claiming its
    whole train split — within the split, and so once accepted — would multiply its weight in every weighted rule.
    The server knows each task's count and bounds the memory by its budget: the claim is rejected in one line."""
    from hostile import _body

    cfg = config("protofcl", train={"rounds": 2}, deploy={"min_clients": 2},
                 data={"tasks": {"memory": memory}}, algorithm={"name": "fedavg"})
    whole = {}

    def claim_all(k, action, rec):
        if (k, action) == (2, "train") and "body" in rec and rec["round"] == 1:
            return _body(rec, action, lambda b: {**b, "n": torch.full_like(b["n"], float(whole[2]))})
        return rec

    (tmp_path / "run.yaml").write_text(dump(cfg))
    grid = LoopGrid(tmp_path / "run.yaml", 3, tmp_path / "nodes", tamper=claim_all)

    def pool(fed):
        whole.update(enumerate(int(s) for s in fed.split["train"].sizes))
        return FlowerPool(grid, fed, "t0k3n", "RESUME")

    with pytest.warns(UserWarning, match="reply of client 2 .* rejected"):
        run(cfg, tmp_path / "r", progress=False, pool=pool)
    got = read_metrics(tmp_path / "r")
    assert got[0]["deploy"]["train"] == {"asked": 3, "answered": 3}  # honest counts, memory or not, pass
    why = got[1]["deploy"]["train"]["rejected"]["2"]
    assert f"sample count {whole[2]}" in why and "not in [" in why, why


def test_too_few_answers_stop_the_run_in_one_line_with_a_resume_command(tmp_path):
    cfg = config("fedavg")  # min_clients: every client asked
    (tmp_path / "run.yaml").write_text(dump(cfg))
    grid = LoopGrid(tmp_path / "run.yaml", 3, tmp_path / "nodes",
                    tamper=lambda k, a, rec: None if (k, a, rec.get("round")) == (0, "train", 1) else rec)
    with pytest.raises(RunError) as e:
        run(cfg, tmp_path / "dep", progress=False, pool=lambda fed: FlowerPool(grid, fed, "t0k3n", "RESUME-IT"))
    msg = str(e.value)
    assert "\n" not in msg and "round 1: 2 of 3 clients answered 'train'" in msg and "no reply from [0]" in msg
    assert msg.endswith("resume: RESUME-IT")
    assert len(read_metrics(tmp_path / "dep")) == 1  # round 0 is kept
    # stopped in round 0, nothing is kept: no resume command that would find nothing
    grid0 = LoopGrid(tmp_path / "run.yaml", 3, tmp_path / "nodes0",
                     tamper=lambda k, a, rec: None if (k, a) == (0, "train") else rec)
    with pytest.raises(RunError) as e:
        run(cfg, tmp_path / "dep0", progress=False, pool=lambda fed: FlowerPool(grid0, fed, "t0k3n", "RESUME-IT"))
    assert "RESUME-IT" not in str(e.value) and "no round was kept: start the run again" in str(e.value)
    assert not (tmp_path / "dep0").exists()


def test_a_refusal_is_one_line_in_flowers_log_and_a_bug_keeps_its_traceback():
    import logging

    from fedmosaic.deploy.server import _one_line_refusals

    def record(exc):
        try:
            raise exc
        except Exception as e:
            return logging.LogRecord("flwr", logging.ERROR, __file__, 1, "%s raised an exception", ("ServerApp",),
                                     (type(e), e, e.__traceback__))
    refusal = record(FedMosaicError("node 7 claims client 1, but its key is not the one made for client 1"))
    assert _one_line_refusals(refusal)
    text = logging.Formatter().format(refusal)
    assert text == "fedmosaic: error: node 7 claims client 1, but its key is not the one made for client 1"
    bug = record(ZeroDivisionError("division by zero"))
    assert "Traceback" in logging.Formatter().format(bug) and _one_line_refusals(bug) and bug.exc_info


def test_a_stopped_deployment_resumes_on_restarted_nodes_with_the_uninterrupted_numbers(tmp_path):
    """Round 1 fails (a node does not answer); the nodes restart (Context.state lost: their state files remain);
    the run resumes from its checkpoint and ends with the metrics of a run that never stopped."""
    cfg = config("ditto", train={"rounds": 3})
    (tmp_path / "run.yaml").write_text(dump(cfg))
    flaky = LoopGrid(tmp_path / "run.yaml", 3, tmp_path / "nodes",
                     tamper=lambda k, a, rec: None if (k, a, rec.get("round")) == (2, "train", 1) else rec)
    with pytest.raises(RunError):
        run(cfg, tmp_path / "dep", progress=False, pool=lambda fed: FlowerPool(flaky, fed, "t0k3n", "R"))
    fresh = LoopGrid(tmp_path / "run.yaml", 3, tmp_path / "nodes")  # new Context.state, same node files
    run(cfg, tmp_path / "dep", resume=True, progress=False, pool=lambda fed: FlowerPool(fresh, fed, "t0k3n", "R"))
    assert same_metrics(read_metrics(tmp_path / "dep"), simulated(cfg, tmp_path), tol=0) == []
    folders = sorted((tmp_path / "nodes").glob("*/client-*"))  # (a client's personal model: its owner's alone)
    assert len(folders) == 3 and all(f.stat().st_mode & 0o777 == 0o700 for f in folders)


def test_the_simulator_refuses_to_resume_a_deployed_run_and_leaves_its_checkpoints(tmp_path):
    cfg = config("fedavg")
    deployed(cfg, tmp_path)
    before = sorted(p.name for p in (tmp_path / "dep" / "checkpoints").iterdir())
    with pytest.raises(FedMosaicError, match="is a deployed run .* resume it with its deployment's `flwr run"):
        run(cfg, tmp_path / "dep", resume=True, progress=False)
    assert sorted(p.name for p in (tmp_path / "dep" / "checkpoints").iterdir()) == before


def test_a_node_without_the_state_it_is_asked_for_answers_an_error(tmp_path):
    cfg = config("ditto")
    (tmp_path / "run.yaml").write_text(dump(cfg))
    grid = LoopGrid(tmp_path / "run.yaml", 3, tmp_path / "nodes")
    deployed(cfg, tmp_path, grid=grid)
    for f in (tmp_path / "nodes" / "t0k3n" / "client-1").glob("*.fmsg"):
        f.unlink()
    grid.nodes[1001].state = type(grid.nodes[1001].state)()  # the node restarted too: nothing left
    with pytest.raises(RunError, match="client 1: the node failed: ValueError: no state of stamp 1 on this node"), \
            pytest.warns(UserWarning, match="train reply of client 1 .* rejected"):
        run(cfg.model_copy(update={"train": cfg.train.model_copy(update={"rounds": 3})}), tmp_path / "dep",
            resume=True, amend=True, progress=False, pool=lambda fed: FlowerPool(grid, fed, "t0k3n", "R"))


@pytest.mark.parametrize("claim, match", [
    ({1: {"partition-id": 0}}, "nodes 1000 and 1001 both claim client 0"),
    ({2: {"partition-id": 7}}, "node 1002 refused the first contact: .*partition-id 7: the config's partition has 3"),
])
def test_first_contact_refuses_nodes_that_do_not_belong(claim, match, tmp_path):
    cfg = config("fedavg")
    (tmp_path / "run.yaml").write_text(dump(cfg))
    grid = LoopGrid(tmp_path / "run.yaml", 3, tmp_path / "nodes", node_config=claim)
    with pytest.raises(FedMosaicError, match=match):
        run(cfg, tmp_path / "dep", progress=False, pool=lambda fed: FlowerPool(grid, fed, "t0k3n", "R"))
    assert not (tmp_path / "dep").exists()  # refused before anything was written


@pytest.mark.parametrize("family, field, match", [
    ("fedavg", "rows", "node 1001 .client 1. holds another partition"),
    ("fedavg", "train", "node 1001 .client 1. holds another partition"),
    ("ahf", "public", "node 1001 .client 1. has another public stream"),
    ("ahf", "arch", "node 1001 .client 1. builds architecture 7"),
])
def test_first_contact_refuses_a_node_with_other_data(family, field, match, tmp_path):
    cfg = config(family)
    (tmp_path / "run.yaml").write_text(dump(cfg))

    def other(k, action, rec):
        return {**rec, field: 7 if field in ("train", "arch") else "0" * 64} if (k, action) == (1, "hello") else rec

    grid = LoopGrid(tmp_path / "run.yaml", 3, tmp_path / "nodes", tamper=other)
    with pytest.raises(FedMosaicError, match=match):
        run(cfg, tmp_path / "dep", progress=False, pool=lambda fed: FlowerPool(grid, fed, "t0k3n", "R"))


def test_a_refusal_at_first_contact_prints_a_nodes_text_as_one_line_without_its_escapes(tmp_path, capsys):
    """A rows hash is a node's text: a terminal escape and a newline in it reached the server's log and its error."""
    cfg = config("fedavg")
    (tmp_path / "run.yaml").write_text(dump(cfg))

    def evil(k, action, rec):
        return {**rec, "rows": "\x1b[2J\x1b[H\nOK: forged"} if (k, action) == (1, "hello") else rec

    grid = LoopGrid(tmp_path / "run.yaml", 3, tmp_path / "nodes", tamper=evil)
    with pytest.raises(FedMosaicError, match="node 1001 .client 1. holds another partition") as e:
        run(cfg, tmp_path / "dep", progress=False, pool=lambda fed: FlowerPool(grid, fed, "t0k3n", "R"))
    said = capsys.readouterr().out + str(e.value)
    assert "holds another partition" in said and "\x1b" not in said and "\nOK: forged" not in said


def test_missing_nodes_are_waited_for_then_refused(tmp_path):
    cfg = config("fedavg", deploy={"connect_timeout_s": 0.5})
    (tmp_path / "run.yaml").write_text(dump(cfg))
    grid = LoopGrid(tmp_path / "run.yaml", 3, tmp_path / "nodes")
    grid.down.add(1002)
    with pytest.raises(FedMosaicError, match=r"clients \[2\] have no node after 0.5 s .*2 nodes online"):
        run(cfg, tmp_path / "dep", progress=False, pool=lambda fed: FlowerPool(grid, fed, "t0k3n", "R"))


@pytest.mark.parametrize("over, match", [
    ({"algorithm": {"name": "central"}}, "pooled data"),
    ({"algorithm": {"name": "ditto"}, "eval": {"cross_clients": True}}, "eval.cross_clients"),
    ({"eval": {"local_models": True}}, "eval.local_models"),
    ({"engine": {"compile": True}}, "engine.compile"),
    ({"engine": {"pool": "wire"}}, "engine.pool"),
    ({"attack": {"kind": "scale"}}, "simulated attackers"),
])
def test_what_only_a_simulation_can_run_is_refused_in_one_line(over, match):
    from cases import DIGITS3
    from fedtest import merged

    from fedmosaic.config import validate

    cfg = validate(merged(DIGITS3, over))
    with pytest.raises(ConfigError, match=match) as e:
        check_deployable(cfg, registered()[cfg.algorithm.name])
    assert "\n" not in str(e.value)


def test_a_replayed_or_restamped_old_upload_is_rejected_and_counts_as_no_reply(tmp_path):
    """Client 2's node answers round 1 with its round-0 reply — as it was (replayed) or stamped round 1: either
    carries the nonce of another request, is rejected with that reason, and the run equals the one where client 2
    sent nothing in round 1 (a free rider cannot pass an old upload off as new)."""
    cfg = config("fedavg", deploy={"min_clients": 2}, train={"rounds": 3})

    def replay(restamp: bool):
        kept = {}

        def tamper(k, action, rec):
            if (k, action) == (2, "train"):
                if rec["round"] == 0:
                    kept.update(rec)
                elif rec["round"] == 1:
                    return {**kept, "round": 1} if restamp else dict(kept)
            return rec
        return tamper

    silent, _ = deployed(cfg, sub(tmp_path, "silent"), "silent",
                         tamper=lambda k, a, rec: None if (k, a, rec.get("round")) == (2, "train", 1) else rec)
    for restamp in (False, True):
        with pytest.warns(UserWarning, match="reply of client 2 .* rejected: it does not answer this request"):
            got, _ = deployed(cfg, sub(tmp_path, f"r{restamp}"), "r", tamper=replay(restamp))
        assert "nonce" in got[1]["deploy"]["train"]["rejected"]["2"]
        assert same_metrics(got, silent, tol=0) == []


def test_a_node_with_another_clients_key_is_refused_at_first_contact(tmp_path):
    """Every client's node key is fixed by `fedmosaic deploy` (node_keys.json): a registered node that claims
    client 1 with client 0's key is refused before anything is written; with the right keys the run goes on."""
    cfg = config("fedavg", train={"rounds": 1})
    (tmp_path / "run.yaml").write_text(dump(cfg))
    made = {k: f"-----BEGIN PUBLIC KEY-----\nKEY{k}\n-----END PUBLIC KEY-----\n" for k in range(3)}
    registered_keys = {1000 + k: made[k].replace("\n", "\r\n") for k in range(3)}  # (wrapped otherwise: the same)
    ok = LoopGrid(tmp_path / "run.yaml", 3, tmp_path / "nodes", keys=registered_keys)
    run(cfg, tmp_path / "ok", progress=False, pool=lambda fed: FlowerPool(ok, fed, "t0k3n", "R", made))
    stolen = LoopGrid(tmp_path / "run.yaml", 3, tmp_path / "nodes", keys={**registered_keys, 1001: made[0]})
    with pytest.raises(FedMosaicError, match="node 1001 claims client 1, but its key is not the one made for client 1"):
        run(cfg, tmp_path / "dep", progress=False, pool=lambda fed: FlowerPool(stolen, fed, "t0k3n", "R", made))
    assert not (tmp_path / "dep").exists()
    unknown = LoopGrid(tmp_path / "run.yaml", 3, tmp_path / "nodes", keys={1000: made[0], 1002: made[2]})
    with pytest.raises(FedMosaicError, match="node 1001 claims client 1, but its key is not"):
        run(cfg, tmp_path / "dep", progress=False, pool=lambda fed: FlowerPool(unknown, fed, "t0k3n", "R", made))


def test_a_reply_far_larger_than_its_layout_is_rejected_before_it_is_decoded(tmp_path, monkeypatch):
    """Under the default deploy.max_reply_mb (512) a node's 8 MiB reply for a model of a few KiB is refused by
    its size alone: the server never decodes (allocates) more than four times what its own runtime answers."""
    from fedmosaic.protocol import codec

    decoded = []
    real = codec.decode
    monkeypatch.setattr(codec, "decode", lambda data, action: decoded.append(len(data)) or real(data, action))
    cfg = config("fedavg", deploy={"min_clients": 2})
    pad = lambda k, a, rec: _pad(rec, a) if (k, a) == (2, "train") else rec  # noqa: E731
    with pytest.warns(UserWarning, match=r"reply of client 2 .* rejected: 8.0 MiB, more than 1.0 MiB \(four times"):
        deployed(cfg, tmp_path, tamper=pad)
    assert max(decoded) < 2**20


def _pad(rec: dict, action: str) -> dict:
    return {**rec, "body": rec["body"] + b"\0" * (8 * 2**20 - len(rec["body"]))}


def test_a_node_naming_other_terms_than_its_peers_is_merged_by_name(tmp_path):
    """The terms of a client's objective are client-reported: a node that names its own is counted under that
    name (its peers' means stay theirs) instead of crashing the merge of the round's replies."""
    got, _ = deployed(config("ditto", train={"rounds": 1}), tmp_path, tamper=poison_train("own_terms", 2))
    assert got[0]["terms"]["mine"] == 1.0 and set(got[0]["terms"]) > {"mine"}, got[0]["terms"]


def test_an_impostor_beside_the_rightful_nodes_is_left_out_and_the_run_goes_on(tmp_path, capsys):
    """A registered node (999) that answers first and claims client 1 with client 0's key is left out with one
    line, and client 1's own node hosts it: one node cannot stop a run whose clients all have their nodes (before,
    its refusal stopped the run). The run equals the simulation."""
    from types import SimpleNamespace

    from flwr.app import RecordDict

    cfg = config("fedavg", train={"rounds": 1})
    (tmp_path / "run.yaml").write_text(dump(cfg))
    made = {k: f"-----BEGIN PUBLIC KEY-----\nKEY{k}\n-----END PUBLIC KEY-----\n" for k in range(3)}
    grid = LoopGrid(tmp_path / "run.yaml", 3, tmp_path / "nodes", keys={1000 + k: made[k] for k in range(3)})
    impostor = SimpleNamespace(node_config={"partition-id": 1, "state-dir": str(tmp_path / "other")},
                               state=RecordDict())
    grid.nodes, grid.keys[999] = {999: impostor, **grid.nodes}, made[0]
    run(cfg, tmp_path / "dep", progress=False, pool=lambda fed: FlowerPool(grid, fed, "t0k3n", "R", made))
    assert "node 999 claims client 1, but its key is not the one made for client 1" in capsys.readouterr().out
    assert same_metrics(read_metrics(tmp_path / "dep"), simulated(cfg, tmp_path), tol=0) == []


def test_a_node_listed_online_but_dead_is_skipped_not_waited_for(tmp_path, capsys):
    """The SuperLink still lists a node that died (for about a minute): first contact goes on with the nodes that
    answer, in the time they take, and says which it skipped."""
    cfg = config("fedavg", train={"rounds": 1}, deploy={"connect_timeout_s": 300})
    (tmp_path / "run.yaml").write_text(dump(cfg))
    grid = LoopGrid(tmp_path / "run.yaml", 3, tmp_path / "nodes")
    grid.silent.add(999)
    import time
    t0 = time.monotonic()
    run(cfg, tmp_path / "dep", progress=False, pool=lambda fed: FlowerPool(grid, fed, "t0k3n", "R"))
    assert time.monotonic() - t0 < 60  # not the 300 s of deploy.connect_timeout_s
    assert "node 999 is listed online but did not answer the first contact: skipped" in capsys.readouterr().out
    assert same_metrics(read_metrics(tmp_path / "dep"), simulated(cfg, tmp_path), tol=0) == []


def test_a_nodes_data_folder_holds_for_its_federation_only(tmp_path):
    """A node's `data-dir` (its node config) is where its federation reads its data; the process's search path
    is as it was afterwards (a node process that hosts the next run, or a test process, is not left with it)."""
    from fedmosaic.paths import data_dirs

    before = data_dirs()
    mine = tmp_path / "node-data"  # (the case's data are scikit-learn's, built in: any folder serves)
    mine.mkdir()
    got, _ = deployed(config(), tmp_path, node_config={k: {"data-dir": str(mine)} for k in range(3)})
    assert got and data_dirs() == before


def test_a_fedkd_reply_claiming_a_huge_svd_width_is_rejected_before_it_is_padded(tmp_path):
    """FedKD's upload travels as the kept SVD components and the full width ``r`` they are padded back to: a node
    stating r = 2**20 made the server allocate (m + n) x r floats before any check (2**26: killed for memory)."""
    from hostile import _body

    def widen(k, action, rec):
        if (k, action) != (2, "train") or "body" not in rec:
            return rec
        return _body(rec, action, lambda b: {**b, "upload": {**b["upload"], "r": {
            n: 2**20 for n in b["upload"]["r"]}}} if "r" in b["upload"] else b)

    cfg = config("fedkd", algorithm={"name": "fedkd", "svd": True}, deploy={"min_clients": 2}, train={"rounds": 1})
    with pytest.warns(UserWarning):
        got, _ = deployed(cfg, tmp_path, tamper=widen)
    why = got[0]["deploy"]["train"]["rejected"]["2"]
    assert "cannot be unpacked" in why and "width r" in why and "1048576" in why


def test_a_fedkd_reply_of_zero_width_factors_as_wide_as_it_likes_is_rejected_before_it_is_padded(tmp_path):
    """The width's bound came from the factors' own shapes: u [1, M, 0] and v [1, 0, M] with r = M passed it, and a
    908-byte reply made the server pad two M x M tensors per matrix (M = 8000: 1 GB). A packed upload must be cut
    from its reference's shapes, checked before unpacking."""
    import torch
    from hostile import _body
    M = 4000

    def flat(k, action, rec):
        if (k, action) != (2, "train") or "body" not in rec:
            return rec

        def change(b):
            up = b["upload"]
            for n in up.get("u", {}):
                up["u"][n], up["v"][n], up["r"][n] = torch.zeros(1, M, 0), torch.zeros(1, 0, M), M
            return b
        return _body(rec, action, change)

    cfg = config("fedkd", algorithm={"name": "fedkd", "svd": True}, deploy={"min_clients": 2}, train={"rounds": 1})
    with pytest.warns(UserWarning):
        got, _ = deployed(cfg, tmp_path, tamper=flat)
    why = got[0]["deploy"]["train"]["rejected"]["2"]
    assert "is not cut from the reference's" in why and str(M) in why
