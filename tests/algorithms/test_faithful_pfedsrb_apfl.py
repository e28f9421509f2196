"""Issue 19, items 6 and 7: pFedSRB's server mean and APFL-PD's plateau detector, computed by hand from the papers'
rules (pFedSRB: Algorithm 1, W^{t+1} = (1/M) Σ_m w_m; APFL-PD: the training loss of the global model, as its Fig. 2
and its code base litian96/FedProx flearn/trainers/fedavg.py log it)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fedtest import BLOBS6, assert_trees_close, blobs6_partition, with_overrides

from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.protocol.program import Signals
from fedmosaic.protocol.tree import tmap
from fedmosaic.setup.world import build_federation


def make_cfg(**over):
    return with_overrides(copy.deepcopy(BLOBS6), **over)


@pytest.fixture(scope="module")
def fd(blob_data):
    return blobs6_partition(blob_data)


# ---- item 6: pFedSRB ---------------------------------------------------------------------------------------
def test_pfedsrb_server_takes_the_plain_mean_by_default_and_the_sample_weighted_one_as_an_option():
    Algo = ALGORITHMS["pfedsrb"]
    uploads = {"model": {"a": torch.tensor([[1.0, 2.0], [3.0, 6.0], [8.0, 1.0]])}}
    n = torch.tensor([10.0, 30.0, 60.0])
    sig = Signals(torch.arange(3), torch.zeros(3), torch.ones(3), 0.1)
    plain = Algo(Algo.Config()).aggregate({"model": None}, uploads, n, 0, sig)["model"]["a"]
    # (1/M) Σ w_m = ([1, 2] + [3, 6] + [8, 1]) / 3
    assert torch.allclose(plain, torch.tensor([4.0, 3.0]))
    weighted = Algo(Algo.Config(server_mean="samples")).aggregate({"model": None}, uploads, n, 0, sig)["model"]["a"]
    # (10 [1, 2] + 30 [3, 6] + 60 [8, 1]) / 100
    assert torch.allclose(weighted, torch.tensor([5.8, 2.6]))


def test_pfedsrb_round_averages_the_cohorts_uploads_with_equal_weights(fd):
    fed = build_federation(make_cfg(algorithm={"name": "pfedsrb", "R": 2}), fd)
    seen = {}
    aggregate = fed.algo.aggregate

    def spy(server, uploads, weights, round_idx, signals):
        seen.update(uploads=tmap(torch.clone, uploads["model"]), weights=weights.clone())
        return aggregate(server, uploads, weights, round_idx, signals)

    fed.algo.aggregate = spy
    fed.round(0)
    assert len(set(seen["weights"].tolist())) > 1  # unequal train sizes: a weighted mean would differ
    assert_trees_close(fed.server["model"], tmap(lambda t: t.sum(0) / t.shape[0], seen["uploads"]))


# ---- item 7: APFL-PD ---------------------------------------------------------------------------------------
def global_train_loss(fed, model, cohort) -> float:
    """Σ_k Σ_i ce(model; x_i, y_i) / Σ_k n_k over the cohort's train samples: the n-weighted mean of the clients'
    mean losses, the global model alone (no masks, no private parts, no EWC term)."""
    tr, g = fed.split["train"], fed.groups[0]
    total, count = 0.0, 0
    for k in cohort:
        x, y = tr.x[tr.ptr[k] : tr.ptr[k + 1]], tr.y[tr.ptr[k] : tr.ptr[k + 1]]
        total += float(F.cross_entropy(g.apply(model, x)[1], y, reduction="sum"))
        count += len(y)
    return total / count


def test_apfl_plateau_detector_reads_the_global_models_training_loss(fd):
    """Window 2, delta large: round 0 fills half the window, round 1 fills it (mean > 0 + 0: a peak), round 2 is a
    plateau (after a peak, mean < delta_mu, std < delta_sigma): mu_old, sigma_old are the window's mean and std of
    the global model's losses of rounds 1 and 2. EWC is on (mu = 1, importance refreshed in round 0) and the model
    decomposes from round 1, so the cohort's running loss differs from this one."""
    algo = {"name": "apfl_pd", "z": 1, "refresh_first": 1, "window": 2, "delta_mu": 50.0, "delta_sigma": 50.0}
    fed = build_federation(make_cfg(algorithm=algo), fd)
    hand, running = [], []
    for t in range(3):
        received = tmap(torch.clone, fed.server["model"])
        hand.append(global_train_loss(fed, received, fed.cohort(t)))
        running.append(fed.round(t)["train_loss"])
    assert fed.server["losses"].tolist() == pytest.approx(hand[1:], rel=1e-5)
    assert int(fed.server["seen"]) == 2 and int(fed.server["plateaus"]) == 1 and bool(fed.server["flag"])
    assert not bool(fed.server["peak"])
    assert float(fed.server["mu_old"]) == pytest.approx(np.mean(hand[1:]), rel=1e-5)
    assert float(fed.server["sigma_old"]) == pytest.approx(np.std(hand[1:]), rel=1e-4, abs=1e-7)
    assert fed.evaluate(2)["report"]["global_train_loss"] == pytest.approx(hand[2], rel=1e-5)
    assert abs(running[2] - hand[2]) > 1e-3  # what the detector read before (the running loss) is another number


def test_apfl_thresholds_apply_to_the_global_loss(fd):
    """delta_mu just above / just below the window mean of the global model's losses decides the refresh."""
    algo = {"name": "apfl_pd", "z": 1, "refresh_first": 1, "window": 2, "delta_sigma": 50.0}
    probe = build_federation(make_cfg(algorithm={**algo, "delta_mu": 50.0}), fd)
    hand = []
    for t in range(3):
        hand.append(global_train_loss(probe, tmap(torch.clone, probe.server["model"]), probe.cohort(t)))
        probe.round(t)
    mean = float(np.mean(hand[1:]))
    for delta_mu, fires in ((mean * 1.001, True), (mean * 0.999, False)):
        fed = build_federation(make_cfg(algorithm={**algo, "delta_mu": delta_mu}), fd)
        for t in range(3):
            fed.round(t)
        assert bool(fed.server["flag"]) == fires  # round 3's clients would send their gradients
