"""Robust aggregation and simulated attacks (issue 38): the rules on hand-made updates, their reductions, the
attackers' choice, and runs where a x1000 client is defeated."""

import json

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_structure

from fedmosaic.cli.main import main
from fedmosaic.config import validate
from fedmosaic.engine import accounting, robust
from fedmosaic.errors import ConfigError
from fedmosaic.protocol.tree import leaves, tmap, weighted_mean
from fedmosaic.reports import catalog
from fedmosaic.runs.records import read_metrics
from fedmosaic.runs.runner import run
from fedmosaic.setup.world import build_federation


def cfg(**over):
    raw = {"seed": 3, "data": {"dataset": "digits", "clients": 10, "partition": {"scheme": "iid"}, "client_test": 0.25},
           "model": {"name": "mlp", "options": {"hidden": 16}},
           "train": {"rounds": 4, "clients_per_round": 10, "batch_size": 16, "optimizer": {"lr": 0.1}},
           "eval": {"client_test": True}, "algorithm": {"name": "fedavg"}}
    return validate({**raw, **over})


def uploads(rows):
    """Stacked uploads of two tensors whose flat concatenation per client is ``rows`` [n, 3]."""
    r = torch.as_tensor(rows, dtype=torch.float32)
    return {"a": r[:, :2].clone(), "b": r[:, 2:].clone()}


REF = {"a": torch.zeros(2), "b": torch.zeros(1)}


def flat(stacked):
    return torch.cat([stacked["a"], stacked["b"]], dim=-1)


def agg(rows, weights=None, **rule):
    w = torch.ones(len(rows)) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    out, w = robust.aggregate(cfg(aggregation=rule), uploads(rows), REF, w)
    return flat(weighted_mean(out, w)), w


ROWS = [[1.0, 2.0, 0.0], [2.0, 1.0, 1.0], [1.5, 1.5, 0.5], [1000.0, -1000.0, 1000.0]]


def test_median_and_trimmed_mean_by_hand_and_their_reductions():
    med, _ = agg(ROWS, rule="median")
    torch.testing.assert_close(med, torch.tensor([1.75, 1.25, 0.75]))  # the two middle values' mean
    trimmed, _ = agg(ROWS, rule="trimmed_mean", trim=0.25)  # one cut at each end of every coordinate
    torch.testing.assert_close(trimmed, torch.tensor([1.75, 1.25, 0.75]))
    for trim in (0.0, 0.09):  # a trim that cuts nothing of the 10 a round samples would be a plain mean: refused
        with pytest.raises(ConfigError, match=r"cuts floor\(trim x 10\) = 0 updates .* set trim >= 0.1"):
            cfg(aggregation={"rule": "trimmed_mean", "trim": trim})


def test_every_clipped_update_is_within_the_bound_and_a_loose_bound_is_fedavg_exactly():
    w = torch.tensor([3.0, 1.0, 2.0, 4.0])
    out, _ = robust.aggregate(cfg(aggregation={"rule": "norm_bound", "clip": 1.0}), uploads(ROWS), REF, w)
    assert bool((flat(out).norm(dim=1) <= 1.0 + 1e-6).all())
    torch.testing.assert_close(flat(out)[0], torch.tensor(ROWS[0]) / torch.tensor(ROWS[0]).norm())
    loose, lw = robust.aggregate(cfg(aggregation={"rule": "norm_bound", "clip": 1e30}), uploads(ROWS), REF, w)
    assert all(torch.equal(loose[k], uploads(ROWS)[k]) for k in loose) and torch.equal(lw, w)
    zero, _ = robust.aggregate(cfg(aggregation={"rule": "norm_bound", "clip": 1.0}), uploads([[0.0] * 3] * 4), REF, w)
    assert torch.equal(flat(zero), torch.zeros(4, 3))  # a zero update does not crash (no 0/0)


def test_krum_keeps_the_update_closest_to_its_neighbours():
    rows = [[0.0, 0.0, 0.0], [0.1, 0.0, 0.0], [0.0, 0.1, 0.0], [0.0, 0.0, 0.1], [50.0, 50.0, 50.0]]
    mean, w = agg(rows, weights=[1, 2, 3, 4, 5], rule="krum", f=1, m=1)
    assert w.tolist() == [1, 0, 0, 0, 0]  # scores: sums of squared distances to its n - f - 2 = 2 nearest
    torch.testing.assert_close(mean, torch.zeros(3))
    _, w3 = agg(rows, weights=[1, 2, 3, 4, 5], rule="krum", f=1, m=4)
    assert w3.tolist() == [1, 2, 3, 4, 0]  # Multi-Krum: the attacker is never among them
    one, w1 = agg([[7.0, 8.0, 9.0]], weights=[2], rule="krum", f=0, m=1)  # one client: that client
    torch.testing.assert_close(one, torch.tensor([7.0, 8.0, 9.0]))
    assert w1.tolist() == [2]


def test_the_attackers_are_fixed_by_the_seed_and_only_their_rows_change():
    a = robust.attackers(100, 0.15, seed=7)
    assert len(a) == 15 and np.array_equal(a, robust.attackers(100, 0.15, seed=7))
    assert not np.array_equal(a, robust.attackers(100, 0.15, seed=8))
    assert len(robust.attackers(10, 0.11, seed=0)) == 2  # rounded up
    c = cfg(attack={"kind": "scale", "fraction": 0.2, "factor": 10.0})
    bad = robust.attackers(10, 0.2, c.seed)
    cohort = np.arange(4, dtype=np.int64) if bad.min() < 4 else np.append(np.arange(3), bad.min())
    out = robust.attack(c, uploads(ROWS), REF, cohort, 0, 10)
    for i, k in enumerate(cohort):
        expect = torch.tensor(ROWS[i]) * (10.0 if k in bad else 1.0)
        torch.testing.assert_close(flat(out)[i], expect)
        if k not in bad:
            assert torch.equal(flat(out)[i], flat(uploads(ROWS))[i])
    rider = robust.attack(cfg(attack={"kind": "free_rider", "fraction": 1.0}), uploads(ROWS), REF, cohort, 0, 10)
    assert torch.equal(flat(rider), torch.zeros(4, 3))
    flip = robust.attack(cfg(attack={"kind": "sign_flip", "fraction": 1.0, "factor": 2.0}), uploads(ROWS), REF,
                         cohort, 0, 10)
    torch.testing.assert_close(flat(flip), -2 * torch.tensor(ROWS))


def test_label_flipping_poisons_only_the_attackers_training_labels_and_applies_to_any_algorithm(tmp_path):
    """label_flip: the attackers' train labels become C - 1 - y; their test labels and every other client's data
    stay; an algorithm with its own server step (SCAFFOLD) runs with it, and the poisoned run differs."""

    c = cfg(attack={"kind": "label_flip", "fraction": 0.3}, algorithm={"name": "scaffold"}, train={"rounds": 1})
    honest, flipped = build_federation(cfg(algorithm={"name": "scaffold"})), build_federation(c)
    bad = robust.attackers(10, 0.3, c.seed)
    tr, ok = flipped.split["train"], honest.split["train"]
    for k in range(10):
        a, b = slice(tr.ptr[k], tr.ptr[k + 1]), slice(ok.ptr[k], ok.ptr[k + 1])
        assert torch.equal(tr.y[a], 9 - ok.y[b] if k in bad else ok.y[b]), k
        assert torch.equal(tr.x[a], ok.x[b])
    assert torch.equal(flipped.split["test"].y, honest.split["test"].y)
    assert len(bad) == 3
    one = run(c, tmp_path / "flip", progress=False)["global_acc_final"]
    assert one != run(cfg(algorithm={"name": "scaffold"}, train={"rounds": 1}), tmp_path / "ok",
                      progress=False)["global_acc_final"]


def test_an_algorithm_with_its_own_server_step_or_too_few_clients_for_krum_is_refused_in_one_line(tmp_path, capsys):
    for over in (["--set", "algorithm={name: scaffold}", "--set", "aggregation={rule: median}"],
                 ["--set", "algorithm={name: fedavgm}", "--set", "attack={kind: scale}"],
                 ["--set", "aggregation={rule: krum, f: 4}"], ["--set", "aggregation={rule: bulyan, f: 2}"],
                 ["--set", "aggregation={rule: trimmed_mean, trim: 0.05}"],
                 ["--set", "privacy={noise: 1.0, clip: 1.0}", "--set", "aggregation={rule: median}"]):
        out = tmp_path / "r"
        assert main(["run", "quickstart", "--set", "compare=null", "--out", str(out), "--no-progress", *over]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and any(m in err[0] for m in ("does not average uploaded models", "2f + 2", "4f + 3",
                                                            "cannot be combined", "cuts floor")), err
        assert not out.exists()


AVERAGING = ["pfedsrb", "fedbn", "fedper", "fedrep", "lg_fedavg", "fedbabu"]


def _round_zero(name: str, **over):
    """The federation after round 0 of ``name`` and what its server step was given: (server state before,
    uploads, weights, signals)."""
    fed = build_federation(cfg(algorithm={"name": name}, **over))
    seen, real = [], fed.algo.aggregate

    def aggregate(server, uploads, weights, t, signals):
        seen.append((server, uploads, weights, signals))
        return real(server, uploads, weights, t, signals)

    fed.algo.aggregate = aggregate
    fed.round(0)
    return fed, seen[0]


@pytest.mark.parametrize("name", AVERAGING)
def test_what_an_algorithm_declares_it_averages_is_a_mean_that_leaves_out_a_weight_of_zero(name):
    """``Algorithm.averages`` lets a robust rule, an upload attack and a server optimizer act on an aggregate of the
    algorithm's own (pFedSRB's plain mean, the shared part of FedBN and the split models): checked on each, since a
    wrong declaration would let a robust rule's rows through unbounded. Rows all equal give that row; a client of
    weight 0 (Krum's dropped ones) changes nothing; nor does anything else the clients send."""
    fed, (server, up, w, signals) = _round_zero(name)
    u, s = robust.averaged(type(fed.algo))

    def again(uploads, weights):  # the algorithm's own server step (not the capturing wrapper)
        return type(fed.algo).aggregate(fed.algo, server, uploads, weights, 0, signals)

    def same(a, b):
        return tree_structure(a) == tree_structure(b) and all(map(torch.equal, leaves(a), leaves(b)))

    out = again({**up, u: tmap(lambda v: v[:1].expand_as(v).clone(), up[u])}, w)
    for k, v in up[u].items():
        torch.testing.assert_close(out[s][k], v[0])
    w0 = w.clone()
    w0[0] = 0
    moved = {**up, u: tmap(lambda v: v.clone().index_fill_(0, torch.tensor([0]), 1e3), up[u])}
    others = {k: tmap(lambda t: t + 1.0 if t.is_floating_point() else t, v) for k, v in up.items() if k != u}
    assert same(again(moved, w0), again(up, w0))
    assert same(again({**up, **others}, w), again(up, w))


@pytest.mark.parametrize("name", ["pfedsrb", "fedbn"])
def test_a_rule_bounds_what_x1000_clients_move_in_an_algorithms_own_mean(name):
    """Two of ten clients upload 1000 x their update: the averaged part of pFedSRB (the paper's plain mean) and
    FedBN (the shared weights) moves hundreds of times further than an honest round under the mean, and no further
    than an honest client's under the median or Krum."""
    def moved(**over):
        fed, (server, *_) = _round_zero(name, **over)
        _, s = robust.averaged(type(fed.algo))
        return torch.cat([(fed.srv.state[s][k] - server[s][k]).flatten() for k in server[s]]).norm()

    honest, attack = moved(), {"kind": "scale", "fraction": 0.2, "factor": 1000.0}
    assert moved(attack=attack) > 100 * honest
    for rule in ({"rule": "median"}, {"rule": "krum", "f": 2, "m": 6}):
        assert moved(attack=attack, aggregation=rule) < 2 * honest, rule


def test_an_aggregate_of_its_own_is_not_averaged_unless_it_says_so_where_it_is_defined():
    from fedmosaic.algorithms.fedbn import FedBN
    from fedmosaic.protocol.algorithm import registered

    class Mine(FedBN):  # a plug-in's own server step below a declaring class: not taken for FedBN's mean
        def aggregate(self, server, uploads, weights, round_idx, signals):
            return server

    class Declared(Mine):
        averages = ("shared", "shared")

    algos = registered()
    assert robust.averaged(Mine) is None and robust.averaged(Declared) == ("shared", "shared")
    assert robust.averaged(algos["fedavg"]) == ("model", "model")
    for name in ("scaffold", "fednova", "fedavgm", "apfl_pd", "fedproto", "ahf", "local", "ifca"):
        assert robust.averaged(algos[name]) is None, name
    for name in AVERAGING:
        assert robust.averaged(algos[name]) is not None and not robust.eligible(algos[name]), name
    # and `fedmosaic list algorithms` says which sections each takes
    heads = {line.split()[0]: line for line in catalog.algorithms() if not line.startswith(" ")}
    assert "; takes aggregation:, attack:, privacy:." in heads["fedavg"]
    assert "; takes aggregation:, attack:." in heads["fedbn"] and "takes" not in heads["scaffold"]


def test_the_rules_bounds_hold_for_the_clients_that_train_and_a_cohort_larger_than_them_is_warned_of(capsys):
    """participation.held_out leaves fewer clients to sample than train.clients_per_round: Bulyan's bound was held
    to the configured 15 while each round sampled the 10 that train; and the smaller cohort went unsaid."""
    base = ["run", "quickstart", "--set", "compare=null", "--set", "participation={held_out: 0.5}", "--check"]
    assert main([*base, "--set", "train.clients_per_round=15", "--set", "aggregation={rule: bulyan, f: 2}"]) == 2
    err = capsys.readouterr().err
    assert "needs at least 4f + 3 = 11 clients a round (a round samples 10 of train.clients_per_round 15" in err
    assert main([*base, "--set", "train.clients_per_round=15"]) == 0
    err = capsys.readouterr().err
    assert "train.clients_per_round: 15, but participation.held_out leaves 10 of the 20 clients that train" in err


def _final(out):
    return read_metrics(out)[-1]["global"]["acc"]


@pytest.mark.slow
def test_a_x1000_client_ruins_fedavg_and_each_defence_holds(tmp_path):
    """Ten IID digits clients, two of them uploading 1000 x their update: FedAvg collapses to about chance, the norm
    bound, the median, the trimmed mean and Krum stay within a few points of the honest run. With neither an attack
    nor a stage (the default) the run is the one without these settings, bit for bit."""
    honest = run(cfg(), tmp_path / "honest", progress=False)
    run(cfg(aggregation={"rule": "mean"}), tmp_path / "mean", progress=False)
    assert [json.dumps(r.get("global")) for r in read_metrics(tmp_path / "mean")] == \
        [json.dumps(r.get("global")) for r in read_metrics(tmp_path / "honest")]
    attack = {"kind": "scale", "fraction": 0.2, "factor": 1000.0}
    run(cfg(attack=attack), tmp_path / "none", progress=False)
    base = _final(tmp_path / "honest")
    assert base > 0.6 and _final(tmp_path / "none") < 0.2, (base, _final(tmp_path / "none"))
    for name, rule in [("clip", {"rule": "norm_bound", "clip": 2.0}), ("median", {"rule": "median"}),
                       ("trimmed", {"rule": "trimmed_mean", "trim": 0.2}), ("krum", {"rule": "krum", "f": 2, "m": 6})]:
        run(cfg(attack=attack, aggregation=rule), tmp_path / name, progress=False)
        assert _final(tmp_path / name) > base - 0.08, (name, _final(tmp_path / name), base)
    assert honest["global_acc_final"] == base


BN = {"name": "fedavg_cnn", "options": {"norm": "batch"}}


def _statistics_after_a_poisoned_round(**over) -> tuple[dict, dict]:
    """The server's BatchNorm statistics after round 0 when client 0 of the cohort uploads running variances of
    -1e4 and running means of 1e4 with an honest model, and the honest clients' statistics."""
    fed = build_federation(cfg(model=BN, **over))
    train, honest = fed.pool.train, {}

    def poisoned(*args, **kw):
        parts = train(*args, **kw)
        got = {k: v.clone() for k, v in parts[0]["buffers"].items()}
        honest.update({k: v[1:] for k, v in got.items()})
        for k, v in got.items():
            if v.is_floating_point():
                v[0] = -1e4 if k.endswith("running_var") else 1e4
        parts[0] = {**parts[0], "buffers": got}
        return parts

    fed.pool.train = poisoned
    fed.round(0)
    return fed.groups[0].global_buffers, honest


@pytest.mark.parametrize("rule", [{"rule": "median"}, {"rule": "trimmed_mean", "trim": 0.2},
                                  {"rule": "krum", "f": 1, "m": 3}])
def test_one_clients_batchnorm_statistics_cannot_move_a_robust_aggregate(rule):
    """The statistics go through the rule with the parameters (as in Flower, whose strategies see them in the
    state dict): every coordinate stays within the honest clients' range. Before, they were averaged outside the
    rule, and a variance of -1e4 from one node took a median-aggregated CNN from 0.68 to 0.10."""
    got, honest = _statistics_after_a_poisoned_round(aggregation=rule)
    for k, v in got.items():
        if v.is_floating_point():
            assert bool((v >= honest[k].min(0).values - 1e-6).all() & (v <= honest[k].max(0).values + 1e-6).all()), k


def test_a_round_with_fewer_updates_than_bulyan_krum_or_the_trimmed_mean_needs_is_skipped_not_aggregated():
    """check() holds the configured cohort to the rule's bounds; clients that drop out (or withhold their replies
    in a deployment) leave fewer: Bulyan's trimmed mean over n <= 4f values was NaN, which was then kept, broadcast
    and checkpointed, and a trimmed mean of 6 at trim 0.15 cut nothing (a plain mean, one x1000 update taking the
    model). Now such a round is skipped with one warning and the server keeps its state."""
    for rule, why in (({"rule": "bulyan", "f": 1}, "bulyan with f = 1 needs"),
                      ({"rule": "krum", "f": 2, "m": 1}, "krum with f = 2 needs"),
                      ({"rule": "trimmed_mean", "trim": 0.15}, "trimmed_mean with trim = 0.15 cuts nothing")):
        fed = build_federation(cfg(aggregation=rule, participation={"dropout": 0.2},
                                   train={"rounds": 4, "clients_per_round": 7, "batch_size": 16}))
        t = next(t for t in range(100) if len(fed.srv.cohort(t)) < 7)  # a round with dropouts: too few for the rule
        before = {k: v.clone() for k, v in fed.srv.state["model"].items()}
        with pytest.warns(UserWarning, match=rf"round {t}: aggregation: {why}"):
            fed.round(t)
        assert all(torch.equal(before[k], v) for k, v in fed.srv.state["model"].items())
        full = next(t for t in range(100) if len(fed.srv.cohort(t)) == 7)
        fed.round(full)  # a full cohort is aggregated, and stays finite
        assert not all(torch.equal(before[k], v) for k, v in fed.srv.state["model"].items())
        assert all(bool(torch.isfinite(v).all()) for v in fed.srv.state["model"].values())


def test_a_server_state_that_overflows_is_never_kept():
    """Finite uploads can still overflow the server's state: one client's update of 1e25 squares to inf in FedAdam's
    second moment (float32), which then stayed inf for the rest of the run (and froze the model: m / sqrt(inf));
    a non-finite aggregate was kept, broadcast and checkpointed. Now the round is skipped with one warning."""
    fed = build_federation(cfg(aggregation={"optimizer": "adam"}))
    train = fed.pool.train

    def huge(*args, **kw):
        parts = train(*args, **kw)
        up = {k: v.clone() for k, v in parts[0]["upload"]["model"].items()}
        for v in up.values():
            v[0] = 1e25
        parts[0] = {**parts[0], "upload": {**parts[0]["upload"], "model": up}}
        return parts

    fed.pool.train = huge
    before = {k: v.clone() for k, v in fed.srv.state["model"].items()}
    with pytest.warns(UserWarning, match=r"round 0: the aggregate of clients \[.*\] is not finite"):
        fed.round(0)
    assert all(torch.equal(before[k], v) for k, v in fed.srv.state["model"].items()) and fed.srv.opt_state is None
    fed.pool.train = train
    fed.round(1)  # the next honest round goes on from it
    assert not all(torch.equal(before[k], v) for k, v in fed.srv.state["model"].items())
    assert all(bool(torch.isfinite(v).all()) for v in fed.srv.opt_state["v"].values())


def test_under_a_rule_one_clients_reported_loss_cannot_cut_everyones_learning_rate():
    """train.optimizer.plateau follows the cohort's losses, which clients report: one reporting 1e30 every round
    makes the mean flat, and the rate falls for all; under a robust rule the plateau follows their median."""
    def scale(**over):
        fed = build_federation(cfg(train={"rounds": 6, "clients_per_round": 10, "batch_size": 16,
                                          "optimizer": {"lr": 0.1, "plateau": {"patience": 0, "factor": 0.5}}},
                                   **over))
        train = fed.pool.train

        def lying(*args, **kw):
            parts = train(*args, **kw)
            parts[0] = {**parts[0], "loss": parts[0]["loss"].clone().index_fill(0, torch.tensor([0]), 1e30)}
            return parts

        fed.pool.train = lying
        for t in range(6):
            fed.round(t)
        return fed.srv.plateau["scale"]

    assert scale() < 1.0 and scale(aggregation={"rule": "median"}) == 1.0


def test_a_mean_of_statistics_never_holds_a_negative_variance_and_privacy_refuses_batchnorm():
    got, _ = _statistics_after_a_poisoned_round()  # the plain mean trusts its clients, but BatchNorm takes roots
    assert all(bool((v >= 0).all()) for k, v in got.items() if k.endswith("running_var"))
    assert any(bool((v > 100).any()) for k, v in got.items() if k.endswith("running_mean"))  # (it did average)
    with pytest.raises(ConfigError, match="BatchNorm running statistics.*norm: group"):
        build_federation(cfg(model=BN, privacy={"noise": 1.0, "clip": 1.0}))


@pytest.mark.slow
def test_attack_and_defence_give_the_same_numbers_on_the_wire_pool(tmp_path):
    over = {"attack": {"kind": "noise", "fraction": 0.3, "sigma": 0.5}, "aggregation": {"rule": "median"}}
    run(cfg(**over), tmp_path / "local", progress=False)
    wire = cfg(**over, engine={"pool": "wire"})
    run(wire, tmp_path / "wire", progress=False)
    local, wire = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "wire")
    assert [r["global"]["class_acc"] for r in local] == [r["global"]["class_acc"] for r in wire]
    assert [r["global"]["loss"] for r in local] == pytest.approx([r["global"]["loss"] for r in wire], rel=1e-6)


def test_the_rules_equal_flowers_on_identical_tensors():
    """Flower 1.42's FedMedian, FedTrimmedAvg, (Multi-)Krum and Bulyan aggregate the parameters themselves; ours the updates
    from the broadcast: the same in exact arithmetic (median and trimmed mean move with a shift, distances do not)."""
    agg_fl = pytest.importorskip("flwr.server.strategy.aggregate")
    gen = torch.Generator().manual_seed(0)
    ref = {"a": torch.randn(2, generator=gen), "b": torch.randn(1, generator=gen)}
    rows = torch.randn(7, 3, generator=gen) * torch.tensor([1.0, 3.0, 0.5])
    rows[2] *= 40  # an outlier
    stacked = {"a": ref["a"] + rows[:, :2], "b": ref["b"] + rows[:, 2:]}
    n_ex = [3, 1, 4, 1, 5, 9, 2]
    results = [([stacked["a"][i].numpy(), stacked["b"][i].numpy()], n_ex[i]) for i in range(7)]
    w = torch.tensor(n_ex, dtype=torch.float32)
    cases = [({"rule": "median"}, agg_fl.aggregate_median(results)),
             ({"rule": "trimmed_mean", "trim": 0.2}, agg_fl.aggregate_trimmed_avg(results, 0.2)),
             ({"rule": "krum", "f": 2, "m": 1}, agg_fl.aggregate_krum(results, 2, 0)),
             ({"rule": "krum", "f": 2, "m": 3}, agg_fl.aggregate_krum(results, 2, 3)),
             ({"rule": "bulyan", "f": 1}, agg_fl.aggregate_bulyan(list(results), 1, agg_fl.aggregate_krum, to_keep=0))]
    for rule, theirs in cases:
        out, ww = robust.aggregate(cfg(aggregation=rule, train={"clients_per_round": 7}), stacked, ref, w)
        ours = weighted_mean(out, ww)
        for k, t in zip(("a", "b"), theirs):
            torch.testing.assert_close(ours[k], torch.as_tensor(t, dtype=torch.float32), atol=1e-5, rtol=1e-5,
                                       msg=f"{rule}: {k}")


@pytest.mark.parametrize("name, strategy", [("adam", "FedAdam"), ("yogi", "FedYogi"), ("adagrad", "FedAdagrad"),
                                            ("avgm", "FedAvgM")])
def test_server_optimizers_equal_flowers_strategies_on_identical_tensors(name, strategy):
    """Three rounds of the same client models: Flower 1.42's strategy (its FedAvg aggregate, then its optimizer
    step) and ours (the algorithm's weighted mean, then ``server_step``) give the same global model."""
    fl = pytest.importorskip("flwr.server.strategy")
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

    gen = torch.Generator().manual_seed(1)
    current = {"a": torch.randn(3, 2, generator=gen, dtype=torch.float64),
               "b": torch.randn(4, generator=gen, dtype=torch.float64)}
    extra = {"server_momentum": 0.9, "server_learning_rate": 1.0} if name == "avgm" else {}  # (ours: fedavgm's)
    theirs = getattr(fl, strategy)(initial_parameters=ndarrays_to_parameters([current["a"].numpy(),
                                                                              current["b"].numpy()]), **extra)
    c = cfg(aggregation={"optimizer": name})
    state, ours = None, dict(current)
    for t in range(3):
        n_ex = [5, 2, 7]
        clients = [{k: v + 0.3 * torch.randn(v.shape, generator=gen, dtype=torch.float64)
                    for k, v in ours.items()} for _ in n_ex]
        results = [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters([m["a"].numpy(), m["b"].numpy()]),
                                 n, {})) for m, n in zip(clients, n_ex, strict=True)]
        params, _ = theirs.aggregate_fit(t + 1, results, [])
        stacked = {k: torch.stack([m[k] for m in clients]) for k in ours}
        mean = weighted_mean(stacked, torch.tensor(n_ex, dtype=torch.float64))
        ours, state = robust.server_step(c, state, ours, mean, t)
        for k, arr in zip(("a", "b"), parameters_to_ndarrays(params)):
            torch.testing.assert_close(ours[k], torch.as_tensor(arr), rtol=1e-6, atol=1e-8, msg=f"round {t}: {k}")


def test_fedavg_with_the_avgm_server_optimizer_is_algorithm_fedavgm(tmp_path):
    """FedAvgM's momentum as a server optimizer (so it composes with a robust rule) is the algorithm fedavgm."""
    opt = run(cfg(aggregation={"optimizer": "avgm", "eta": 0.7, "beta1": 0.5}), tmp_path / "opt", progress=False)
    run(cfg(algorithm={"name": "fedavgm", "beta": 0.5, "server_lr": 0.7}), tmp_path / "algo", progress=False)
    a, b = read_metrics(tmp_path / "opt"), read_metrics(tmp_path / "algo")
    for x, y in zip(a, b, strict=True):
        assert x["global"]["acc"] == y["global"]["acc"]
        assert x["global"]["loss"] == pytest.approx(y["global"]["loss"], rel=1e-5)
    assert opt["global_acc_final"] != run(cfg(), tmp_path / "plain", progress=False)["global_acc_final"]


def test_a_server_optimizers_moments_are_checkpointed_a_resume_equals_the_whole_run(tmp_path):
    c = cfg(aggregation={"optimizer": "yogi", "eta": 0.05}, checkpoint_every=1)
    run(c, tmp_path / "whole", progress=False)
    run(c, tmp_path / "cut", progress=False, stop_after=1)
    run(c, tmp_path / "cut", progress=False, resume=True)
    whole, cut = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "cut")
    assert [r["global"] for r in whole] == [r["global"] for r in cut]
    plain = run(cfg(), tmp_path / "plain", progress=False)
    assert plain["global_acc_final"] != whole[-1]["global"]["acc"]  # (the optimizer changed the run)


# ---- client-level differential privacy -------------------------------------------------------------------------
def test_the_accountant_meets_published_reference_values():
    pytest.importorskip("dp_accounting")
    # dp-accounting's / Opacus's RDP test vector: sigma 1.5, Poisson q 0.04, 2250 steps, delta 1e-5
    assert accounting.rdp_epsilon(1.5, 2250, 1e-5, poisson=0.04) == pytest.approx(7.3293, abs=1e-3)
    # the fixed-size cohorts the engine samples (replace-one neighbours): more rounds, more noise, fewer sampled
    eps = accounting.rdp_epsilon(1.0, 100, 1e-5, fixed=(1000, 10))
    assert accounting.rdp_epsilon(1.0, 200, 1e-5, fixed=(1000, 10)) > eps > accounting.rdp_epsilon(2.0, 100, 1e-5,
                                                                                           fixed=(1000, 10))
    assert accounting.rdp_epsilon(1.0, 100, 1e-5, fixed=(1000, 100)) > eps
    assert accounting.rdp_epsilon(0.0, 5, 1e-5) == float("inf") and accounting.rdp_epsilon(1.0, 0, 1e-5) == 0.0


def _private(noise, clip, rows, seed=3, t=0):
    c = cfg(privacy={"noise": noise, "clip": clip})
    return flat(robust.private(c, uploads(rows), REF, t)[0])


def test_dp_clips_every_update_and_a_noise_free_loose_bound_is_the_plain_mean():
    out = _private(0.0, 1.0, ROWS)  # each clipped to norm 1, then averaged: every row holds the mean
    clipped = torch.tensor(ROWS) / torch.tensor(ROWS).norm(dim=1, keepdim=True).clamp(min=1.0)
    torch.testing.assert_close(out, clipped.mean(0).expand(4, -1))
    loose = _private(0.0, 1e30, ROWS)
    torch.testing.assert_close(loose[0], flat(weighted_mean(uploads(ROWS), torch.ones(4))))  # FedAvg, equal sizes
    assert torch.equal(_private(0.0, 1.0, [[0.0] * 3] * 4), torch.zeros(4, 3))  # a zero update: no 0/0


def test_dp_noise_has_std_sigma_c_over_m_and_is_seeded_by_the_round():
    n, p = 4, 60_000
    c = cfg(privacy={"noise": 2.0, "clip": 0.5})
    stacked, ref = {"w": torch.zeros(n, p)}, {"w": torch.zeros(p)}
    noise = robust.private(c, stacked, ref, 0)[0]["w"][0]
    assert float(noise.std()) == pytest.approx(2.0 * 0.5 / n, rel=0.02) and abs(float(noise.mean())) < 0.005
    assert torch.equal(noise, robust.private(c, stacked, ref, 0)[0]["w"][0])
    assert not torch.equal(noise, robust.private(c, stacked, ref, 1)[0]["w"][0])


def test_local_dp_clips_each_clients_update_and_adds_noise_of_std_sigma_c_seeded_by_round_and_client():
    p = 60_000
    rows = torch.zeros(3, p)
    rows[0, 0], rows[1, :2] = 10.0, 0.1  # one update above the clip, one below, one zero
    ref, clients = {"w": torch.ones(p)}, np.array([4, 7, 9])
    quiet = robust.local(cfg(privacy={"mode": "local", "noise": 0.0, "clip": 2.0}), {"model": {"w": 1 + rows}}, ref,
                         clients, 0)["model"]["w"] - 1
    torch.testing.assert_close(quiet[0].norm(), torch.tensor(2.0))  # clipped to C
    torch.testing.assert_close(quiet[1:], rows[1:])  # within C: as it was
    c = cfg(privacy={"mode": "local", "noise": 1.5, "clip": 2.0})
    noisy = robust.local(c, {"model": {"w": 1 + rows}}, ref, clients, 0)["model"]["w"] - 1
    for i in range(3):
        assert float((noisy[i] - quiet[i]).std()) == pytest.approx(1.5 * 2.0, rel=0.02)
    again = robust.local(c, {"model": {"w": 1 + rows[[1]]}}, ref, clients[[1]], 0)["model"]["w"] - 1
    assert torch.equal(again[0], noisy[1])  # a client's noise is its own, whoever else is in the cohort
    assert not torch.equal(noisy[1], (robust.local(c, {"model": {"w": 1 + rows}}, ref, clients, 1)["model"]["w"] - 1)[1])


@pytest.mark.slow
def test_a_local_dp_run_is_the_same_on_the_wire_pool_and_accounts_each_client_without_sampling(tmp_path, capsys):
    """The noise is added inside the client runtime (on a deployment: on the node), so the wire pool, where each
    client is a runtime of its own, gives the in-process numbers; epsilon is sigma / 2's, every round, no sampling."""
    pytest.importorskip("dp_accounting")
    over = {"privacy": {"mode": "local", "noise": 2.0, "clip": 0.5}, "train": {"rounds": 2, "clients_per_round": 5}}
    run(cfg(**over), tmp_path / "local", progress=False)
    run(cfg(**over, engine={"pool": "wire"}), tmp_path / "wire", progress=False)
    a, b = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "wire")
    assert [r["global"]["class_acc"] for r in a] == [r["global"]["class_acc"] for r in b]
    assert [r["privacy"]["epsilon"] for r in a] == pytest.approx([accounting.rdp_epsilon(1.0, t, 1e-5) for t in (1, 2)])
    central = run(cfg(privacy={"noise": 2.0, "clip": 0.5}, train=over["train"]), tmp_path / "central",
                  progress=False)
    assert central["global_acc_final"] != a[-1]["global"]["acc"]
    assert main(["run", "quickstart", "--set", "compare=null", "--out", str(tmp_path / "x"), "--no-progress", "--set",
                 "privacy={mode: local, noise: 1.0, clip: 1.0, adaptive: {count_noise: 1.0}}"]) == 2
    assert "never shows it" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_after_local_dp_a_robust_rule_defeats_a_node_that_skips_its_clipping(tmp_path):
    """Local DP trusts each node to clip its own update; one that sends 1000 x its update instead wrecks the
    uniform mean. A rule after local DP is post-processing (the privacy holds), so it is allowed, and the median
    stays within a few points of the honest private run."""
    pytest.importorskip("dp_accounting")
    private = {"privacy": {"mode": "local", "noise": 0.05, "clip": 2.0}}
    attack = {"kind": "scale", "fraction": 0.2, "factor": 1000.0}
    run(cfg(**private), tmp_path / "honest", progress=False)
    run(cfg(**private, attack=attack), tmp_path / "none", progress=False)
    run(cfg(**private, attack=attack, aggregation={"rule": "median"}), tmp_path / "median", progress=False)
    base = _final(tmp_path / "honest")
    assert base > 0.5 and _final(tmp_path / "none") < 0.2, (base, _final(tmp_path / "none"))
    assert _final(tmp_path / "median") > base - 0.08, (_final(tmp_path / "median"), base)


def test_a_private_run_reports_epsilon_each_round_and_stops_before_its_budget(tmp_path, capsys):
    pytest.importorskip("dp_accounting")
    out = tmp_path / "dp"
    assert main(["run", "quickstart", "--set", "compare=null", "--set", "train.rounds=8", "--out", str(out),
                 "--set", "privacy={noise: 1.0, clip: 1.0, max_epsilon: 6.0}", "--no-progress"]) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if "privacy" in ln]
    assert len(err) == 1 and "round 2 would bring epsilon to 7.4" in err[0]
    recs = read_metrics(out)
    eps = [r["privacy"]["epsilon"] for r in recs]
    assert len(recs) == 2 and eps[0] < eps[1] <= 6.0
    assert json.loads((out / "summary.json").read_text())["epsilon"] == eps[-1]
    assert eps[-1] == pytest.approx(accounting.rdp_epsilon(1.0, 2, 1e-5, fixed=(20, 10)))


def test_the_accountant_samples_from_the_clients_that_can_be_chosen_not_the_held_out_ones(tmp_path):
    """participation.held_out clients are never sampled: with half of 20 held out, a cohort of 10 is every client
    that trains, every round, and no sampling amplifies the privacy. The accountant counted all 20 (epsilon 7.47
    where 9.01 is spent after 3 rounds)."""
    pytest.importorskip("dp_accounting")
    out = tmp_path / "dp"
    assert main(["run", "quickstart", "--set", "compare=null", "--set", "train.rounds=3", "--out", str(out),
                 "--set", "privacy={noise: 1.0, clip: 1.0}", "--set", "participation={held_out: 0.5}",
                 "--no-progress"]) == 0
    recs = read_metrics(out)
    assert {r["clients"] for r in recs} == {10}
    assert recs[-1]["privacy"]["epsilon"] == pytest.approx(accounting.rdp_epsilon(1.0, 3, 1e-5))
    assert recs[-1]["privacy"]["epsilon"] > accounting.rdp_epsilon(1.0, 3, 1e-5, fixed=(20, 10)) + 1


def test_adaptive_clipping_settles_at_the_target_quantile_where_flowers_rule_collapses():
    """Andrew et al.'s rule moves the clip by the fraction of updates it left *unclipped*; Flower 1.42's
    DifferentialPrivacyServerSideAdaptiveClipping feeds the fraction it *clipped* into the same formula
    (flwr/server/strategy/dp_adaptive_clipping.py: norm_bit = scaling_factor < 1), so its clip falls without end."""
    norms = torch.linspace(1.0, 10.0, 50)  # 50 updates; their median 5.5, their 80% quantile ~8.2
    stacked, ref = {"w": torch.stack([torch.tensor([x, 0.0]) for x in norms])}, {"w": torch.zeros(2)}
    for q in (0.5, 0.8):
        c = cfg(privacy={"noise": 0.0, "clip": 0.1, "adaptive": {"quantile": q, "lr": 0.2, "count_noise": 1.0}})
        clip = None
        for t in range(300):
            _, clip = robust.private(c, stacked, ref, t, clip)
        assert float((norms <= clip).float().mean()) == pytest.approx(q, abs=0.06), (q, clip)
    flower = 0.1  # their rule, from the same start and without count noise
    for _ in range(300):
        flower *= np.exp(-0.2 * (float((norms > flower).float().mean()) - 0.5))
    assert flower < 1e-3


def test_a_private_runs_clip_is_checkpointed_a_resume_equals_the_whole_run(tmp_path):
    pytest.importorskip("dp_accounting")
    c = cfg(privacy={"noise": 0.5, "clip": 0.5, "adaptive": {"count_noise": 1.0}}, checkpoint_every=1)
    run(c, tmp_path / "whole", progress=False)
    run(c, tmp_path / "cut", progress=False, stop_after=1)
    run(c, tmp_path / "cut", progress=False, resume=True)
    whole, cut = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "cut")
    assert [(r["global"], r["privacy"]) for r in whole] == [(r["global"], r["privacy"]) for r in cut]
    assert len({r["privacy"]["clip"] for r in whole}) == len(whole)  # it moved every round


def test_a_run_without_noise_reports_no_epsilon_and_its_table_prints(tmp_path, capsys):
    """noise 0 guarantees nothing: epsilon None in metrics.jsonl and the summary, "-" in the table."""
    pytest.importorskip("dp_accounting")
    out = tmp_path / "dp0"
    assert main(["run", "quickstart", "--set", "compare=null", "--set", "train.rounds=2", "--out", str(out),
                 "--set", "privacy={noise: 0.0, clip: 1.0}", "--no-progress"]) == 0
    assert [r["privacy"]["epsilon"] for r in read_metrics(out)] == [None, None]
    assert json.loads((out / "summary.json").read_text())["epsilon"] is None
    assert "DP epsilon" in capsys.readouterr().out
