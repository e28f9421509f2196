"""``participation``: clients that drop out of a round after being chosen, and clients held out of training and
evaluated apart — each drawn from (seed, round, client), so every algorithm and every pool sees the same."""

from __future__ import annotations

import copy
import sys

import numpy as np
import pytest
import torch
from fedtest import BLOBS6, CONTINUAL, blobs6_partition, merged, with_overrides

from fedmosaic.engine.federation import Federation
from fedmosaic.engine.seeding import drop_out, work_shares
from fedmosaic.errors import ConfigError
from fedmosaic.runs.checkpoints import run_hash
from fedmosaic.setup.world import build_federation

TWENTY = merged(BLOBS6, {"data": {"clients": 20}, "train": {"clients_per_round": 8, "rounds": 4}})


def cfg_of(raw, **over):
    return with_overrides(merged(copy.deepcopy(raw), over))


def rounds(fed: Federation, n: int) -> list[dict]:
    out = []
    for t in range(n):
        rec = fed.round(t)
        rec.update(fed.evaluate(t))
        out.append({k: v for k, v in rec.items() if not k.startswith("time")})
    return out


def test_a_client_drops_by_a_draw_of_its_own_and_if_all_drop_one_stays():
    chosen = np.array([1, 4, 7, 9])
    kept = drop_out(chosen, 0.5, 12, seed=3, round_idx=2)
    assert set(kept) <= set(chosen) and len(kept) < len(chosen)
    for k in kept:  # a client's fate does not depend on who else was chosen
        assert np.array_equal(drop_out(np.array([k, 11]), 0.5, 12, seed=3, round_idx=2)[:1], [k])
    assert np.array_equal(drop_out(chosen, 0.0, 12, 3, 2), chosen)
    assert len(drop_out(chosen, 0.999, 12, 3, 2)) == 1  # nobody would answer: the lowest draw stays


def test_dropped_clients_neither_train_nor_count_and_every_algorithm_sees_the_same_rounds(blob_data):
    fd = blobs6_partition(blob_data)
    cfg = cfg_of(BLOBS6, algorithm={"name": "ditto"}, participation={"dropout": 0.4})
    fed = build_federation(cfg, fd)
    t = next(t for t in range(20) if len(fed.srv.cohort(t)) < len(fed.srv.chosen(t)))  # a round with dropouts
    for r in range(t):
        fed.round(r)
    before = copy.deepcopy(fed.groups[0].store)
    rec = fed.round(t)
    chosen, answered = fed.srv.chosen(t), fed.srv.cohort(t)
    assert rec["dropped"] == np.setdiff1d(chosen, answered).tolist() and rec["dropped"]
    assert rec["clients"] == len(answered)
    for k in rec["dropped"]:  # its personal model untouched
        row = int(fed.row_of[k])
        assert all(torch.equal(a[row], b[row]) for a, b in zip(
            fed.groups[0].store["personal"].values(), before["personal"].values(), strict=True))
    other = build_federation(cfg_of(BLOBS6, algorithm={"name": "fedavg"}, participation={"dropout": 0.4}), fd)
    assert all(np.array_equal(other.srv.cohort(t), fed.srv.cohort(t)) for t in range(5))


def test_the_server_rules_over_every_client_count_only_the_clients_that_train():
    """SCAFFOLD's c += |S|/N mean dc and FedDyn's h -= alpha/m sum(theta - theta0): N and m are the training
    population, so held-out clients (who never send a correction) do not shrink the server's state."""
    from fedmosaic.protocol.program import Signals

    w = torch.ones(2)
    sig = Signals(torch.tensor([0, 1]), w, w, 0.1)
    for name in ("scaffold", "feddyn"):
        fed = build_federation(cfg_of(TWENTY, algorithm={"name": name}, participation={"held_out": 0.25}))
        assert len(fed.srv.held_out) == 5 and fed.algo.trained_clients == 15 and fed.algo.num_clients == 20
        assert build_federation(cfg_of(TWENTY, algorithm={"name": name})).algo.trained_clients == 20
        algo, server = fed.algo, fed.server
        # two clients, each every weight moved by +1 from the server's model (FedDyn) / each dc = 1 (SCAFFOLD)
        up = {k: torch.stack([v + 1, v + 1]) for k, v in server["model"].items()}
        if name == "scaffold":  # c += |S|/N mean dc = 2/15
            new = algo.aggregate(server, {"model": up, "dc": {k: torch.ones_like(v) for k, v in up.items()}}, w, 0,
                                 sig)["c"]
            want = 2 / 15
        else:  # h -= alpha/m sum(theta - theta0) = -alpha 2/15
            new, want = algo.aggregate(server, {"model": up}, w, 0, sig)["h"], -algo.cfg.alpha * 2 / 15
        for v in new.values():
            torch.testing.assert_close(v, torch.full_like(v, want))


def test_held_out_clients_never_train_and_are_evaluated_apart():
    fed = build_federation(cfg_of(TWENTY, algorithm={"name": "ditto"}, participation={"held_out": 0.25},
                                  eval={"cross_clients": True}))
    held = fed.srv.held_out
    assert len(held) == 5
    init = copy.deepcopy(fed.groups[0].store)
    last = rounds(fed, 4)[-1]
    assert not any(np.isin(fed.srv.cohort(t), held).any() for t in range(4))
    rows = [int(fed.row_of[k]) for k in held]
    for a, b in zip(fed.groups[0].store["personal"].values(), init["personal"].values(), strict=True):
        assert torch.equal(a[rows], b[rows])  # never trained
    tested = fed.split["test"].sizes > 0
    assert last["held_out"]["personal"]["clients"] == int(tested[held].sum())
    assert last["personal"]["clients"] == int(tested.sum() - tested[held].sum())
    assert last["personal"]["acc"] > last["held_out"]["personal"]["acc"]  # their personal models are untrained
    # the cross-client means too: of the training clients' models on their splits, the held-out ones apart
    m = np.array(last["cross"]["matrix"])
    train = np.setdiff1d(np.flatnonzero(tested), held)
    assert last["cross"]["intra_avg"] == pytest.approx(np.diag(m)[train].mean())
    assert last["cross"]["intra_avg"] == pytest.approx(last["personal"]["acc_mean"])
    assert last["cross"]["inter_avg"] == pytest.approx(np.mean([m[i, np.setdiff1d(train, [i])].mean()
                                                                for i in train]))
    assert last["held_out"]["cross"]["intra_avg"] == pytest.approx(np.diag(m)[np.intersect1d(held, np.flatnonzero(
        tested))].mean())


def test_held_out_clients_are_evaluated_after_fine_tuning_where_the_algorithm_fine_tunes():
    """FedAvg + fine-tuning: a held-out client never trains in a round, but its personal model is the global model
    fine-tuned on its own train split, as every client's — on label-skewed clients it beats the global model."""
    fed = build_federation(cfg_of(TWENTY, algorithm={"name": "fedavg_ft"}, participation={"held_out": 0.25}))
    last = rounds(fed, 4)[-1]["held_out"]
    assert last["personal"]["clients"] == last["global_clients"]["clients"] > 0
    assert last["personal"]["acc"] > last["global_clients"]["acc"]


def test_participation_is_the_same_on_the_wire_pool_and_off_it_changes_nothing(blob_data):
    fd = blobs6_partition(blob_data)
    raw = {"algorithm": {"name": "ditto"}, "participation": {"dropout": 0.3, "held_out": 0.2, "stragglers": 0.5},
           "engine": {"backend": "sequential"}}
    a = rounds(build_federation(cfg_of(BLOBS6, **raw), fd), 3)
    b = rounds(build_federation(cfg_of(BLOBS6, **raw), fd, pool="wire"), 3)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("bytes", "payload_bytes"))}  # noqa: E731
                        for r in rs]
    assert strip(a) == strip(b) and "held_out" in a[0] and any(r.get("dropped") for r in a)
    plain = cfg_of(BLOBS6, algorithm={"name": "ditto"})
    off = cfg_of(BLOBS6, algorithm={"name": "ditto"}, participation={"dropout": 0.0, "held_out": 0.0})
    assert rounds(build_federation(plain, fd), 2) == rounds(build_federation(off, fd), 2)
    assert run_hash(plain) == run_hash(with_overrides(merged(copy.deepcopy(BLOBS6), {"algorithm": {"name": "ditto"},
                                                                                     "participation": None})))


def test_held_out_clients_with_a_task_stream_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^participation.held_out: .*task stream") as e:
        build_federation(cfg_of(merged(BLOBS6, CONTINUAL), algorithm={"name": "fedlwf"},
                                participation={"held_out": 0.2}))
    assert "\n" not in str(e.value)


def test_a_straggler_runs_the_first_share_of_its_steps_and_the_others_all(blob_data):
    """FedProx's systems heterogeneity: a straggler (a draw of its own per round) stops after ceil(share x steps) of
    its plan, at least one — its model is exactly that of the same client given that many steps."""
    from fedmosaic.protocol.program import Phase

    assert work_shares(np.arange(4), 0.0, 0, 1) is None
    shares = work_shares(np.arange(30), 0.5, 0, 1)
    assert ((shares > 0) & (shares <= 1)).all() and 0 < (shares < 1).sum() < 30
    assert work_shares(np.array([7]), 0.5, 0, 1)[0] == shares[7]  # whoever else trains that round
    fd = blobs6_partition(blob_data)
    fed = build_federation(cfg_of(BLOBS6, algorithm={"name": "fedavg"}, train={"local_epochs": 3},
                            engine={"backend": "sequential"}), fd)
    g, clients = fed.groups[0], np.arange(6)
    args = (fed.split["train"], clients, fed.algo.broadcast(fed.server, 0), g.store, g.buffers)
    kw = {"lr": 0.05, "seed": 5, "round_idx": 2, "own": fed.runtime.own(fed.assign(clients), clients)}
    full = g.trainer.train(*args, **kw)
    some = g.trainer.train(*args, stragglers=0.6, **kw)
    share = work_shares(clients, 0.6, 5, 2)
    want = np.where(share < 1, np.maximum(1, np.ceil(share * full.steps)), full.steps)
    assert np.array_equal(some.steps, want) and (want < full.steps).any()
    k = int(np.argmax(want < full.steps))
    alone = g.trainer.train(fed.split["train"], clients[k:k + 1], args[2], g.store, g.buffers,
                            program=[Phase(steps=int(want[k]))], **{**kw, "own": fed.runtime.own(
                                fed.assign(clients[k:k + 1]), clients[k:k + 1])})
    for name, v in some.uploads["model"].items():
        assert torch.equal(v[k], alone.uploads["model"][name][0])



@pytest.mark.parametrize("algo", ["fedrod", "ifca", "fedpac", "apfl_pd", "fedcurv"])
def test_a_stragglers_probes_measure_its_whole_data_not_only_the_steps_it_trained(blob_data, algo):
    """A probe over one pass of a client's samples (FedRoD's class counts, IFCA's cluster losses, FedPAC's and
    APFL-PD's statistics) or over its first batches (FedCurv's Fisher) is a measurement: a straggler that trained on
    a share of its batches still measures the same samples as when it trains them all (the cut plan once crashed
    the probe: 9 steps against 10)."""
    fd = blobs6_partition(blob_data)

    def measured(**over):
        fed = build_federation(cfg_of(BLOBS6, algorithm={"name": algo}, train={"local_epochs": 1}, **over), fd)
        trainer, seen = fed.groups[0].trainer, []
        batches = trainer._probe_batches

        def spy(data, rows, masks):
            seen.append(masks.sum(-1).sum(0).cpu())  # the samples each client's probe passes over
            return batches(data, rows, masks)

        trainer._probe_batches = spy
        rounds(fed, 3)
        return seen

    plain, slow = measured(), measured(participation={"stragglers": 0.9})
    assert plain and len(slow) == len(plain)
    assert all(torch.equal(a, b) for a, b in zip(plain, slow, strict=True))


def test_no_two_kinds_of_random_draw_share_a_generator(monkeypatch):
    """Every draw of a run — cohorts, dropouts, held-out clients, stragglers, the attackers and their noise, local
    DP noise — comes from a generator keyed by (seed, stream, ...): two kinds of draw with one key would be the same
    random numbers (the attack noise of round 1 once was round c's dropout draws for client c)."""
    from fedmosaic.engine import robust, seeding

    used: dict[tuple, set] = {}
    real = seeding.rng

    def spy(seed, stream, *keys):
        f = sys._getframe(1)
        while f.f_code.co_name.startswith("<"):  # (a comprehension: the function it is in)
            f = f.f_back
        used.setdefault((seed, stream, *keys), set()).add(f.f_code.co_name)
        return real(seed, stream, *keys)

    monkeypatch.setattr(seeding, "rng", spy)
    monkeypatch.setattr(robust, "rng", spy)
    for extra in ({"attack": {"kind": "noise", "fraction": 0.4, "sigma": 1.0}},
                  {"privacy": {"mode": "local", "noise": 0.5, "clip": 1.0}}):
        fed = build_federation(cfg_of(TWENTY, **extra, train={"rounds": 20}, participation={
            "dropout": 0.3, "held_out": 0.2, "stragglers": 0.5}))
        for t in range(20):  # (as many rounds as clients: every client id is also a round's)
            fed.round(t)
    kinds = set().union(*used.values())
    assert {"drop_out", "held_out", "work_shares", "attackers", "_client_noise"} <= kinds
    assert not {k: v for k, v in used.items() if len(v) > 1}
