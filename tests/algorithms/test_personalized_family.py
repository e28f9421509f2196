"""The personalized family on the round program: reductions, hand-computed updates, vectorized ≡ sequential and
resume ≡ uninterrupted for every method."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fedtest import BLOBS6, assert_trees_close, blobs6_partition, train, with_overrides

from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.algorithms.apfl_pd import plateau_step
from fedmosaic.algorithms.fedkd import truncated_svd
from fedmosaic.algorithms.fedpac import collaboration_weights, simplex_projection
from fedmosaic.algorithms.pfedsrb import soft_threshold
from fedmosaic.engine.client.plans import view_offsets
from fedmosaic.errors import ConfigError
from fedmosaic.protocol.algorithm import Algorithm
from fedmosaic.protocol.context import LocalContext
from fedmosaic.protocol.program import Phase, Signals, Step, View
from fedmosaic.protocol.tree import leaves, tmap
from fedmosaic.runs.records import TIMING_KEYS, read_metrics
from fedmosaic.runs.runner import run
from fedmosaic.setup.world import build_federation

NEW = [
    {"name": "apfl_pd", "z": 1, "refresh_first": 2},
    {"name": "pfedsrb", "R": 2},
    {"name": "pfedsrb", "R": 2, "personal": "local"},
    {"name": "pfedme", "K": 2},
    {"name": "perfedavg"},
    {"name": "fedmeta"},
    {"name": "fedavg_ft", "adapt_steps": 3},
    {"name": "central"},
    {"name": "fedala"},
    {"name": "fedpac"},
    {"name": "fedkd", "mentor": "mlp", "mentor_options": {"hidden": 16}},
    {"name": "fedper"},
    {"name": "fedrep", "head_epochs": 2},
    {"name": "lg_fedavg"},
    {"name": "fedbabu", "ft_epochs": 1},
    {"name": "feddyn", "alpha": 0.1},
    {"name": "fedrod"},
    {"name": "apfl", "alpha": 0.4},
    {"name": "fedbn"},
    {"name": "ifca", "clusters": 3},
]


def make_cfg(**over):
    return with_overrides(copy.deepcopy(BLOBS6), **over)


@pytest.fixture(scope="module")
def fd(blob_data):
    return blobs6_partition(blob_data)


def strip_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


# ---- every new method ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("algo", NEW, ids=lambda a: a["name"])
def test_vectorized_equals_sequential(fd, algo):
    ref = train(make_cfg(algorithm=algo, engine={"backend": "sequential"}), fd)
    vec = train(make_cfg(algorithm=algo, engine={"chunk_size": 3}), fd)  # chunks: 4 clients a round
    assert_trees_close(ref.server, vec.server)
    if leaves(ref.groups[0].store):
        assert_trees_close(ref.groups[0].store, vec.groups[0].store)
    ev_ref, ev_vec = ref.evaluate(2), vec.evaluate(2)
    assert ev_ref.keys() == ev_vec.keys()
    assert ("personal" in ev_ref) == ALGORITHMS[algo["name"]].personalized
    for key, value in ev_ref.items():
        if key == "report":  # the algorithm's own measures (pFedSRB's sparsity)
            assert value == pytest.approx(ev_vec[key], abs=1e-6)
        else:
            assert value["acc"] == pytest.approx(ev_vec[key]["acc"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("algo", NEW, ids=lambda a: a["name"])
def test_resume_equals_uninterrupted(fd, algo, tmp_path):
    cfg = make_cfg(algorithm=algo, train__rounds=4)
    run(cfg, tmp_path / "full", progress=False, fd=fd)
    run(cfg, tmp_path / "cut", progress=False, fd=fd, stop_after=1)  # "killed" after round 1 (checkpoint at 1)
    run(cfg, tmp_path / "cut", progress=False, fd=fd, resume=True)
    assert strip_timing(read_metrics(tmp_path / "cut")) == strip_timing(read_metrics(tmp_path / "full"))
    full = json.loads((tmp_path / "full" / "summary.json").read_text())
    cut = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert {k: v for k, v in full.items() if "time" not in k} == {k: v for k, v in cut.items() if "time" not in k}


# ---- APFL-PD -----------------------------------------------------------------------------------------------
def test_apfl_with_unit_masks_no_private_part_and_mu0_trains_as_fedavg(fd):
    a = train(make_cfg(algorithm={"name": "fedavg"}, train__rounds=4), fd)
    held = {"mask_init": 30.0, "init": "zero", "learn_mask": False, "learn_private": False}  # sigmoid(30) == 1.0f
    b = train(make_cfg(algorithm={"name": "apfl_pd", "mu": 0.0, "z": 1, **held}, train__rounds=4), fd)
    assert torch.sigmoid(torch.tensor(30.0)) == 1.0
    assert_trees_close(a.server["model"], b.server["model"], exact=True)
    assert int(b.groups[0].store["started"].sum()) > 0  # the decomposed path did run


def test_apfl_decomposition_changes_training(fd):
    a = train(make_cfg(algorithm={"name": "fedavg"}, train__rounds=3), fd)
    b = train(make_cfg(algorithm={"name": "apfl_pd", "mu": 0.0, "z": 1}, train__rounds=3), fd)
    assert not torch.allclose(leaves(a.server["model"])[0], leaves(b.server["model"])[0])


def test_apfl_importance_update_matches_hand_computed_two_clients(fd):
    """F after round 0 = lam * 0 + sum_k p_k (grad of client k's mean train loss at the model it received)^2."""
    cfg = make_cfg(algorithm={"name": "apfl_pd", "refresh_first": 1, "lam": 0.5}, train__clients_per_round=2)
    fed = build_federation(cfg, fd)
    received = tmap(torch.clone, fed.server["model"])
    g = fed.groups[0]
    cohort = np.sort(np.random.default_rng([cfg.seed, 1, 0]).choice(fed.num_clients, 2, replace=False))
    fed.round(0)
    tr = fed.split["train"]
    expected, n_total = None, 0
    for k in cohort:
        x, y = tr.x[tr.ptr[k] : tr.ptr[k + 1]], tr.y[tr.ptr[k] : tr.ptr[k + 1]]
        params = {n: t.clone().requires_grad_(True) for n, t in received.items()}
        loss = F.cross_entropy(g.apply(params, x)[1], y)  # the mean over all of client k's samples
        grads = torch.autograd.grad(loss, list(params.values()))
        sq = {n: gr.detach() ** 2 * len(y) for n, gr in zip(params, grads)}
        expected = sq if expected is None else tmap(torch.add, expected, sq)
        n_total += len(y)
    assert_trees_close(fed.server["F"], tmap(lambda t: t / n_total, expected), atol=1e-6, rtol=1e-4)
    fed.round(1)  # refresh_first = 1 and no plateau yet: F stays
    assert_trees_close(fed.server["F"], tmap(lambda t: t / n_total, expected), atol=1e-6, rtol=1e-4)


def test_plateau_detector_fires_exactly_where_the_rule_says():
    """Window 3, delta = (1, 0.5). A peak once the window mean exceeds the last plateau's mean + std (0 + 0 at
    first); a refresh once, after a peak, the window mean < 1 and its std < 0.5."""
    series = [3.0, 2.0, 1.5, 0.9, 0.6, 0.5, 0.45, 0.44, 2.0, 2.5, 0.4, 0.4, 0.4, 0.4]
    det = {"losses": [], "peak": False, "mu_old": 0.0, "sigma_old": 0.0}
    fired, peaks = [], []
    for t, loss in enumerate(series):
        det, refresh = plateau_step(det, loss, 3, 1.0, 0.5)
        fired += [t] * refresh
        peaks.append(det["peak"])
    # t=2: first full window (mean 2.17 > 0): peak. Window means: t3 1.47, t4 1.0 (not < 1), t5 0.667 std 0.17
    # -> refresh at 5 (mu_old 0.667, sigma_old 0.170). t6 0.517, t7 0.463: no peak. t8 (0.45, 0.44, 2.0) mean 0.963
    # > 0.837: peak; t9 mean 1.647; t10 (2, 2.5, .4) 1.633; t11 (2.5, .4, .4) 1.1; t12 0.4 std 0 -> refresh at 12.
    assert fired == [5, 12]
    assert peaks[:2] == [False, False] and peaks[2] and not peaks[5] and not peaks[7] and peaks[8] and not peaks[12]


def test_apfl_plateau_refresh_reaches_the_next_round(fd):
    """A plateau flagged in round t makes the clients of round t + 1 send their gradients (one model more each)."""
    cfg = make_cfg(algorithm={"name": "apfl_pd", "refresh_first": 0, "window": 1, "delta_mu": 100.0,
                              "delta_sigma": 100.0}, train__rounds=4)
    fed = build_federation(cfg, fd)
    recs = [fed.round(t) for t in range(4)]
    # round 0: window full, mean > 0: peak; round 1: plateau -> flag; round 2 sends gradients; round 3: peak again
    assert [r["payload_bytes_up"] for r in recs[:2]] == [recs[0]["payload_bytes_up"]] * 2
    model_bytes = sum(t.numel() * t.element_size() for t in leaves(fed.server["model"]))
    assert recs[2]["payload_bytes_up"] == recs[0]["payload_bytes_up"] + recs[2]["clients"] * model_bytes
    assert float(fed.server["F"][next(iter(fed.server["F"]))].abs().sum()) > 0


def test_apfl_personal_model_falls_back_to_global_before_decomposition(fd):
    fed = train(make_cfg(algorithm={"name": "apfl_pd", "z": 10}, train__rounds=2), fd)
    ev = fed.evaluate(1)
    assert ev["personal"]["acc"] == pytest.approx(ev["global_clients"]["acc"])


# ---- pFedSRB -----------------------------------------------------------------------------------------------
def test_soft_threshold_and_dual_update_on_a_hand_example():
    x = torch.tensor([-0.30, -0.01, 0.0, 0.015, 0.5])
    assert torch.allclose(soft_threshold(x, 0.02), torch.tensor([-0.28, 0.0, 0.0, 0.0, 0.48]))
    algo = ALGORITHMS["pfedsrb"](ALGORITHMS["pfedsrb"].Config(beta=0.02, rho=2.0))
    w, W, u = {"a": torch.tensor([1.0, 0.2])}, {"a": torch.tensor([0.5, 0.2])}, {"a": torch.tensor([0.1, -0.005])}
    state = {"S": {"a": torch.zeros(2)}, "u": u}
    _, state = algo.s_step({"model": w}, state, {"global": W})
    # S = soft(w - W + u, beta / rho = 0.01) = soft([0.6, -0.005]) = [0.59, 0]
    assert torch.allclose(state["S"]["a"], torch.tensor([0.59, 0.0]))
    _, state = algo.dual_step({"model": w}, state, {"global": W})
    # u = u + w - S - W = [0.1 + 1 - 0.59 - 0.5, -0.005 + 0.2 - 0 - 0.2]
    assert torch.allclose(state["u"]["a"], torch.tensor([0.01, -0.005]))


def test_pfedsrb_w_step_penalty_by_hand_after_an_s_step_and_a_dual_step():
    """The w-step minimises f(w) + (rho/2) ||w - S - W + u||^2 with the S and u of its iteration (the penalty's
    anchor W + S - u is made by the S-step; the dual step of the iteration before moved u): the penalty's value and
    gradient at a w of the step, by hand; the anchor does not outlive the round."""
    algo = ALGORITHMS["pfedsrb"](ALGORITHMS["pfedsrb"].Config(beta=0.02, rho=2.0))
    W, u = {"a": torch.tensor([0.5, 0.2])}, {"a": torch.tensor([0.1, -0.005])}
    _, state = algo.s_step({"model": {"a": torch.tensor([1.0, 0.2])}}, {"S": {"a": torch.zeros(2)}, "u": u},
                           {"global": W})  # S = [0.59, 0] (the test above)
    w = torch.tensor([0.9, 0.3], requires_grad=True)
    ctx = LocalContext(lambda p, x, slot=None: (x, x), {"model": {"a": w}}, state, {"global": W},
                       torch.zeros(1, 2), torch.tensor([0]), torch.ones(1))
    loss = algo.loss(ctx)
    # w - S - W + u = [0.9 - 0.59 - 0.5 + 0.1, 0.3 - 0 - 0.2 - 0.005] = [-0.09, 0.095]; (rho/2) * sum of squares
    assert float(ctx.terms["admm_penalty"]) == pytest.approx(0.0081 + 0.009025, rel=1e-5)
    (g,) = torch.autograd.grad(loss - ctx.terms["task_loss"], [w])
    assert torch.allclose(g, 2.0 * torch.tensor([-0.09, 0.095]), atol=1e-6)  # rho (w - S - W + u)
    _, kept = algo.finish({"model": {"a": w}}, state, {"global": W}, {})
    assert set(kept) == {"S", "u"}


def test_pfedsrb_with_s_held_at_zero_and_one_iteration_is_fedprox(fd):
    a = train(make_cfg(algorithm={"name": "fedprox", "mu": 0.7}, train__rounds=2), fd)
    b = train(make_cfg(algorithm={"name": "pfedsrb", "rho": 0.7, "R": 1, "learn_s": False, "server_mean": "samples"},
                       train__rounds=2), fd)
    assert_trees_close(a.server["model"], b.server["model"], atol=1e-6, rtol=1e-5)
    assert all(float(t.abs().sum()) == 0 for t in leaves(b.groups[0].store["S"]))


def test_pfedsrb_reports_a_sparse_personal_part(fd):
    fed = train(make_cfg(algorithm={"name": "pfedsrb", "beta": 0.001, "R": 3}, train__rounds=2), fd)
    ev = fed.evaluate(1)
    nonzero = sum(int((t != 0).sum()) for t in leaves(fed.groups[0].store["S"]))
    total = sum(t[0].numel() for t in leaves(fed.groups[0].store["S"])) * fed.num_clients
    assert 0 < nonzero < total
    assert ev["report"]["personal_nonzero"] == pytest.approx(nonzero / fed.num_clients)
    assert ev["report"]["personal_sparsity"] == pytest.approx(1 - nonzero / total)


def test_pfedsrb_personal_local_is_the_last_uploaded_model_and_w_plus_s_before_the_first_round(fd):
    """``personal: local`` evaluates each client's last local model w_m (its upload), and W + S_m for a client that
    has not trained yet; the default is W + S_m for every client."""
    fed = build_federation(make_cfg(algorithm={"name": "pfedsrb", "R": 2, "personal": "local"}), fd)
    uploads = []
    orig = fed.algo.aggregate
    fed.algo.aggregate = lambda s, up, *a: uploads.append(tmap(torch.clone, up)) or orig(s, up, *a)
    rec = fed.round(0)
    cohort = np.sort(np.random.default_rng([5, 1, 0]).choice(6, rec["clients"], replace=False))
    store, W = fed.groups[0].store, fed.server["model"]
    personal = [fed.algo.personal_params(tmap(lambda t, r=r: t[r], store), {"global": W})
                for r in fed.row_of[np.arange(6)]]
    for i, cid in enumerate(cohort):
        assert_trees_close(personal[cid], tmap(lambda t, i=i: t[i], uploads[0]["model"]), atol=0, rtol=0)
    for cid in sorted(set(range(6)) - set(cohort.tolist())):  # not trained: W + S_m (S_m = 0)
        assert_trees_close(personal[cid], W, atol=0, rtol=0)
    default = ALGORITHMS["pfedsrb"](ALGORITHMS["pfedsrb"].Config())
    row = tmap(lambda t: t[fed.row_of[cohort[0]]], store)
    assert_trees_close(default.personal_params(row, {"global": W}), tmap(torch.add, W, row["S"]), atol=0, rtol=0)
    assert not torch.equal(next(iter(personal[cohort[0]].values())), next(iter(W.values())))


# ---- pFedMe, Per-FedAvg, FedMeta, FedAvg + FT, central -----------------------------------------------
def test_pfedme_without_moreau_pull_is_local_sgd_from_the_global_model(fd):
    """lam = 0, K = 1: theta does plain SGD at personal_lr on the round's batches (FedAvg's upload at that lr) and
    w_loc gets no gradient, so the server model does not move."""
    fedavg = build_federation(make_cfg(algorithm={"name": "fedavg"}, train__optimizer={"lr": 0.09}), fd)
    pfedme = build_federation(make_cfg(algorithm={"name": "pfedme", "lam": 0.0, "K": 1, "personal_lr": 0.09}), fd)
    before = tmap(torch.clone, pfedme.server["model"])
    uploads = []
    orig = fedavg.algo.aggregate
    fedavg.algo.aggregate = lambda s, up, *a: uploads.append(tmap(torch.clone, up)) or orig(s, up, *a)
    rec = fedavg.round(0)
    pfedme.round(0)
    assert_trees_close(pfedme.server["model"], before, atol=1e-7, rtol=1e-6)  # a mean of equal copies
    cohort = np.sort(np.random.default_rng([5, 1, 0]).choice(6, rec["clients"], replace=False))
    rows = torch.as_tensor(pfedme.row_of[cohort])
    assert_trees_close(tmap(lambda t: t[rows], pfedme.groups[0].store["theta"]), uploads[0]["model"],
                       atol=1e-6, rtol=1e-5)


def _ctx(fed, params, x, y, m, pair):
    g = fed.groups[0]
    return LocalContext(g.apply, {"model": params}, {}, {}, x, y, m, "ce", pair)


@pytest.mark.cpu
@pytest.mark.parametrize("name", ["perfedavg", "fedmeta"])
def test_meta_gradient_matches_hand_computed_maml(fd, name):
    """Per-FedAvg: grad f(w - a * stopgrad(grad f(w; D)); D'). FedMeta: the same without stopgrad (second order)."""
    fed = build_federation(make_cfg(algorithm={"name": name, "alpha": 0.3}), fd)
    tr = fed.split["train"]
    x, y, x2, y2 = tr.x[:8], tr.y[:8], tr.x[8:16], tr.y[8:16]
    m = torch.ones(8)
    w = tmap(torch.clone, fed.server["model"])
    got = torch.func.grad(lambda p: fed.algo.loss(_ctx(fed, p, x, y, m, (x2, y2, m))))(w)
    p = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    inner = torch.autograd.grad(F.cross_entropy(fed.groups[0].apply(p, x)[1], y), list(p.values()),
                                create_graph=name == "fedmeta")
    adapted = {k: v - 0.3 * (gi if name == "fedmeta" else gi.detach()) for (k, v), gi in zip(p.items(), inner)}
    outer = torch.autograd.grad(F.cross_entropy(fed.groups[0].apply(adapted, x2)[1], y2), list(p.values()))
    assert_trees_close(got, dict(zip(p, outer)), atol=1e-6, rtol=1e-4)


@pytest.mark.cpu
def test_first_order_and_second_order_meta_gradients_differ(fd):
    fed = build_federation(make_cfg(algorithm={"name": "fedmeta", "alpha": 0.3}), fd)
    tr = fed.split["train"]
    w, m = fed.server["model"], torch.ones(8)
    ctx = lambda p: _ctx(fed, p, tr.x[:8], tr.y[:8], m, (tr.x[8:16], tr.y[8:16], m))
    second = torch.func.grad(lambda p: fed.algo.loss(ctx(p)))(w)
    first = torch.func.grad(lambda p: ALGORITHMS["perfedavg"](ALGORITHMS["perfedavg"].Config(alpha=0.3)).loss(ctx(p)))(w)
    assert not torch.allclose(leaves(first)[0], leaves(second)[0])


@pytest.mark.parametrize("name", ["perfedavg", "fedmeta", "fedavg_ft"])
def test_fine_tuning_before_evaluation_never_reads_test_data(fd, name):
    fed = train(make_cfg(algorithm={"name": name}), fd)
    g = fed.groups[0]
    before = fed.personal(g, 2)
    test = fed.split["test"]
    test.x.copy_(torch.randn_like(test.x) * 100)  # any use of the test inputs would change the personal models
    test.y.copy_((test.y + 1) % fd.num_classes)
    assert_trees_close(fed.personal(g, 2), before, exact=True)
    assert not torch.allclose(leaves(before)[0], leaves(fed.server["model"])[0][None].expand_as(leaves(before)[0]))


def test_fedavg_ft_trains_exactly_as_fedavg(fd):
    a = train(make_cfg(algorithm={"name": "fedavg"}), fd)
    b = train(make_cfg(algorithm={"name": "fedavg_ft"}), fd)
    assert_trees_close(a.server["model"], b.server["model"], exact=True)


def test_support_and_query_views_split_each_client(fd):
    for n in (1, 5, 37):
        s = view_offsets(View("support", 0.8), n, 1, 3, 0)
        q = view_offsets(View("query", 0.8), n, 1, 3, 7)  # the same split in every round
        assert len(s) == int(np.ceil(0.8 * n)) and len(s) + len(q) == n
        assert sorted(np.concatenate([s, q]).tolist()) == list(range(n))
    a, b = view_offsets(View("sample", 0.5), 20, 1, 3, 0), view_offsets(View("sample", 0.5), 20, 1, 3, 1)
    assert len(a) == len(b) == 10 and set(a.tolist()) != set(b.tolist())  # drawn again every round


def test_fedmeta_batches_come_from_support_and_query(fd):
    fed = build_federation(make_cfg(algorithm={"name": "fedmeta"}), fd)
    g, tr = fed.groups[0], fed.split["train"]
    k = 0
    plan = g.trainer._plan(tr, np.array([k]), fed.algo.program(0)[0], 0, 5, 0, ())
    s = set((tr.ptr[k] + view_offsets(View("support", 0.8), int(tr.sizes[k]), 5, k, 0)).tolist())
    used = plan["rows"][plan["mask"] > 0].tolist()
    used2 = plan["rows2"][plan["mask2"] > 0].tolist()
    assert set(used) == s and not set(used2) & s and len(set(used2)) == tr.sizes[k] - len(s)


def test_central_deals_the_pooled_train_samples_out_again(fd):
    plain = build_federation(make_cfg(algorithm={"name": "fedavg"}), fd)
    pooled = build_federation(make_cfg(algorithm={"name": "central"}), fd)
    a, b = plain.split["train"], pooled.split["train"]
    assert np.array_equal(a.sizes, b.sizes)
    assert sorted(map(tuple, a.x.tolist())) == sorted(map(tuple, b.x.tolist()))
    assert not torch.equal(a.y, b.y)
    assert torch.equal(plain.split["test"].x, pooled.split["test"].x)


# ---- the program's contracts -------------------------------------------------------------------------------
def test_a_misspelt_slot_is_one_line_before_training(fd, monkeypatch):
    class Typo(Algorithm):
        name = "typo"

        def program(self, round_idx):
            return [Phase(updates=(Step(("modle",)),))]

    monkeypatch.setitem(ALGORITHMS, "typo", Typo)
    with pytest.raises(ConfigError, match="'modle', but local_init returns only \\['model'\\]"):
        build_federation(make_cfg(algorithm={"name": "typo"}), fd)


def test_every_client_hook_sees_its_own_id(fd):
    seen = []

    class Ids(Algorithm):
        name = "ids"

        def finish(self, params, state, payload, stats):
            return {"model": params["model"], "cid": payload["own"]["cid"].float()}, state

        def aggregate(self, server, uploads, weights, round_idx, signals):
            seen.append((uploads["cid"].long().tolist(), signals.clients.tolist(), signals.loss.shape))
            return super().aggregate(server, uploads, weights, round_idx, signals)

    ALGORITHMS["ids"] = Ids
    try:
        fed = build_federation(make_cfg(algorithm={"name": "ids"}, engine={"chunk_size": 3}), fd)
        fed.round(0)
    finally:
        del ALGORITHMS["ids"]
    ids, clients, shape = seen[0]
    assert ids == clients and len(ids) == 4 and shape == (4,)


def test_summary_picks_the_round_by_validation_never_by_test():
    from fedmosaic.runs.records import summarize

    base = {"bytes_up": 1, "bytes_down": 1, "train_loss": 0.0}
    recs = [{**base, "round": 0, "personal": {"acc": 0.5}, "personal_val": {"acc": 0.9},
             "global_clients": {"acc": 0.4}, "global_val": {"acc": 0.6}},
            {**base, "round": 1, "personal": {"acc": 0.8}, "personal_val": {"acc": 0.7},
             "global_clients": {"acc": 0.7}, "global_val": {"acc": 0.8}, "report": {"personal_sparsity": 0.9}}]
    s = summarize(recs, make_cfg())
    assert s["personal_acc_best_by_val"] == 0.5 and s["best_round_by_personal_val"] == 0
    assert s["global_clients_acc_best_by_val"] == 0.7 and s["best_round_by_global_val"] == 1
    assert s["personal_acc_mean"] == pytest.approx(0.65) and s["personal_sparsity_final"] == 0.9


def test_a_client_with_nothing_to_pair_with_trains_without_error(fd):
    """FedMeta on a client whose one sample is all support (no query): its paired batches are empty, so its
    meta-gradient is 0 and its model does not move — in a cohort where no client has query samples."""
    from fedmosaic.engine.tensors import ClientTensors

    fed = build_federation(make_cfg(algorithm={"name": "fedmeta"}), fd)
    g, tr = fed.groups[0], fed.split["train"]
    data = ClientTensors(tr.x[:1], tr.y[:1], np.array([0, 1]))
    payload = fed.algo.broadcast(fed.server, 0)
    up, _, loss, steps, _ = g.trainer.train(data, np.array([0]), payload, {}, {}, lr=0.1, seed=0, round_idx=0,
                                            program=fed.algo.program(0))
    assert steps.tolist() == [1] and float(loss[0]) == 0.0
    assert_trees_close(tmap(lambda t: t[0], up["model"]), fed.server["model"], exact=True)


# ---- FedALA ------------------------------------------------------------------------------------------------
def test_fedala_first_round_trains_exactly_as_fedavg(fd):
    """Every client's first round: w_loc = w_glob, so A cannot move and mix = the global model (with every tensor
    mixed, p = 0), and the training phase keeps FedAvg's batch schedule (key 0)."""
    a = train(make_cfg(algorithm={"name": "fedavg"}), fd, rounds=1)
    b = train(make_cfg(algorithm={"name": "fedala", "p": 0}), fd, rounds=1)
    assert_trees_close(a.server["model"], b.server["model"], exact=True)


@pytest.mark.cpu
def test_fedala_weights_follow_the_projected_gradient_on_a_hand_example(fd):
    """One ALA step: A <- clip(A - eta * dL/dmix * (w_glob - w_loc), 0, 1), from A = 1."""
    cfg = make_cfg(algorithm={"name": "fedala", "p": 2, "eta": 50.0, "sample": 1.0}, train__batch_size=500)
    fed = build_federation(cfg, fd)
    algo, g = fed.algo, fed.groups[0]
    glob = tmap(torch.clone, fed.server["model"])
    local = {k: v + 0.3 * torch.randn_like(v) for k, v in glob.items()}
    state = {"local": local, "A": {k: torch.ones_like(glob[k]) for k in algo._top(glob)},
             "seen": torch.full((), 2.0)}  # (past the start phase: one pass)
    tr = fed.split["train"]
    x, y = tr.x[tr.ptr[0] : tr.ptr[1]], tr.y[tr.ptr[0] : tr.ptr[1]]
    mix = {k: v.clone().requires_grad_(True) for k, v in glob.items()}  # A = 1: mix = w_glob
    grads = dict(zip(mix, torch.autograd.grad(F.cross_entropy(g.apply(mix, x)[1], y), list(mix.values()))))
    expected = {k: (1 - 50.0 * grads[k] * (glob[k] - local[k])).clamp(0, 1) for k in state["A"]}
    stacked = tmap(lambda t: t[None], state)
    own = {"cid": torch.tensor([0])}
    new_state = g.trainer.train(tr, np.array([0]), algo.broadcast(fed.server, 0), stacked, {}, own=own, lr=0.1,
                                seed=0, round_idx=0, program=algo.program(0)[:1])[1]
    assert_trees_close(tmap(lambda t: t[0], new_state["A"]), expected, atol=1e-6, rtol=1e-4)
    assert all(float(t.min()) >= 0 and float(t.max()) <= 1 for t in leaves(new_state["A"]))
    assert any(float(t.min()) < 1 for t in leaves(new_state["A"]))  # it moved


# ---- FedPAC ------------------------------------------------------------------------------------------------
def test_simplex_projection_on_hand_examples():
    got = simplex_projection(torch.tensor([[0.5, 0.5], [2.0, 0.0], [0.3, 0.2], [-1.0, 3.0], [1.0, 1.0]]))
    want = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.55, 0.45], [0.0, 1.0], [0.5, 0.5]])
    torch.testing.assert_close(got, want)


def test_fedpac_collaboration_weights_on_hand_examples():
    """Equal statistics and equal variances: the combination that minimises sum a_j^2 V is the uniform one. No
    variance: each client keeps exactly its own head. Two equal clients and a far one (V = 1): with
    a = (t, t, 1 - 2t) for client 0, the objective (1-2t)^2 d + 2 t^2 + (1-2t)^2 is minimal at t = (d+1)/(2d+3)."""
    h = torch.ones(3, 2, 4)
    torch.testing.assert_close(collaboration_weights(h, torch.ones(3)), torch.full((3, 3), 1 / 3))
    h = torch.randn(3, 2, 4)
    torch.testing.assert_close(collaboration_weights(h, torch.zeros(3)), torch.eye(3))
    far = torch.zeros(3, 1, 1)
    far[2] = 2.0  # d = ||h_2 - h_0||^2 = 4
    t = (4 + 1) / (2 * 4 + 3)
    torch.testing.assert_close(collaboration_weights(far, torch.ones(3), iters=5000)[0],
                               torch.tensor([t, t, 1 - 2 * t]), atol=1e-5, rtol=0)


@pytest.mark.cpu
def test_fedpac_server_centroids_heads_and_statistics(fd):
    """aggregate: centroids = count-weighted mean of the class means; each cohort client's new head = its
    collaboration weights (from h = prior x class mean and V = (mean squared norm - sum_c prior^2 ||mean||^2) / n)
    applied to the uploaded heads; other clients keep theirs."""
    fed = build_federation(make_cfg(algorithm={"name": "fedpac"}), fd)
    algo, server = fed.algo, fed.server
    assert algo.setting.head_keys == ("fc.weight", "fc.bias")
    C, d = algo.num_classes, algo.feature_dim
    count = torch.tensor([[2.0, 0, 1, 0, 4], [1, 3, 0, 0, 2]])[:, :C]  # class 3: nobody
    sums = torch.randn(2, C, d) * (count > 0)[..., None]  # (a class a client lacks sums to 0)
    sq = torch.tensor([5.0, 7.0])
    heads = {k: torch.randn(2, *v.shape[1:]) for k, v in server["heads"].items()}
    body = {k: v.unsqueeze(0).repeat(2, *([1] * v.dim())) for k, v in server["model"].items() if k not in heads}
    ups = {"body": body, "head": heads, "sum": sums, "h_sum": sums, "count": count, "sq": sq}
    sig = Signals(torch.tensor([4, 1]), torch.zeros(2), torch.ones(2), 0.1)
    new = algo.aggregate(server, ups, torch.tensor([3.0, 4.0]), 0, sig)
    mu = sums / count.clamp(min=1)[..., None]
    want = (count[..., None] * mu).sum(0) / count.sum(0).clamp(min=1)[:, None]
    torch.testing.assert_close(new["protos"], want)
    assert new["has"].tolist() == [1.0, 1.0, 1.0, 0.0, 1.0]
    n = count.sum(1)
    prior = count / n[:, None]
    V = (sq / n - (prior**2 * (mu * mu).sum(-1)).sum(1)) / n
    alpha = collaboration_weights(prior[..., None] * mu, V, cut=1e-3)
    for k, t in heads.items():
        torch.testing.assert_close(new["heads"][k][4], alpha[0, 0] * t[0] + alpha[0, 1] * t[1])
        torch.testing.assert_close(new["heads"][k][1], alpha[1, 0] * t[0] + alpha[1, 1] * t[1])
        torch.testing.assert_close(new["heads"][k][0], server["heads"][k][0])  # not in the cohort


def own_head(own, i):
    return tmap(lambda t: t[i], own["head"])


def test_fedpac_phases_train_only_their_part(fd):
    """Without the head phase the uploaded head is the one the client received (its own, from the server), and
    the head phase alone leaves the body at the global one."""
    fed = build_federation(make_cfg(algorithm={"name": "fedpac", "head_epochs": 0}), fd)
    g, algo = fed.groups[0], fed.algo
    clients = np.array([0, 3])
    own = fed.own(clients)
    args = (fed.split["train"], clients, algo.broadcast(fed.server, 0), tmap(lambda t: t[:2], g.store), {})
    up = g.trainer.train(*args, own=own, lr=0.1, seed=0, round_idx=0, program=algo.program(0),
                         probes=algo.probes(0, fed.algo.broadcast(fed.server, 0)))[0]
    assert_trees_close(up["head"], own["head"], exact=True)
    tr = fed.split["train"]
    for i, k in enumerate(clients):  # the "final" probe: one pass over the client's data at its final model
        z, _ = g.apply({**tmap(lambda t, i=i: t[i], up["body"]), **own_head(own, i)}, tr.x[tr.ptr[k] : tr.ptr[k + 1]])
        onehot = F.one_hot(tr.y[tr.ptr[k] : tr.ptr[k + 1]], algo.num_classes).float()
        torch.testing.assert_close(up["sum"][i], onehot.T @ z, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(up["count"][i], onehot.sum(0))
    w = up["body"]["body.0.weight"]
    assert not torch.equal(w, fed.server["model"]["body.0.weight"].expand_as(w))
    fed2 = build_federation(make_cfg(algorithm={"name": "fedpac", "head_epochs": 1}), fd)
    up = fed2.groups[0].trainer.train(*args, own=own, lr=0.1, seed=0, round_idx=0,
                                      program=fed2.algo.program(0)[:1],
                                      probes=fed2.algo.probes(0, fed2.algo.broadcast(fed2.server, 0)))[0]
    body = {k: v[None].expand(2, *v.shape) for k, v in fed2.server["model"].items() if k in up["body"]}
    assert_trees_close(up["body"], body, exact=True)
    assert not torch.equal(up["head"]["fc.weight"], own["head"]["fc.weight"])


# ---- FedKD -------------------------------------------------------------------------------------------------
def test_truncated_svd_keeps_the_fewest_components_reaching_the_energy():
    """Singular values 3, 2, 1 (energies 9, 4, 1 of 14): 0.6 keeps one (9/14 = 0.64), 0.9 two (13/14 = 0.93),
    0.95 all three; with all kept the factors rebuild the matrix."""
    q1, _ = torch.linalg.qr(torch.randn(5, 3, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(4, 3, dtype=torch.float64))
    d = q1 @ torch.diag(torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)) @ q2.T
    for energy, k in ((0.6, 1), (0.9, 2), (0.95, 3)):
        us, vh = truncated_svd(d, torch.tensor(energy))
        assert int((us.abs().sum(0) > 0).sum()) == k and int((vh.abs().sum(1) > 0).sum()) == k
        s_kept = torch.tensor([3.0, 2.0, 1.0])[:k]
        torch.testing.assert_close(torch.linalg.matrix_norm(us @ vh).square().item(), float((s_kept**2).sum()))
    torch.testing.assert_close(us @ vh, d)


def test_fedkd_adaptive_mutual_distillation_on_a_hand_example(fd):
    """loss = L_s + L_t + (KL(p_t||p_s) + KL(p_s||p_t)) / (L_s + L_t) on fixed logits (per-sample KL)."""
    fed = build_federation(make_cfg(algorithm={"name": "fedkd", "tau": 2.0, "kd_reduction": "sample"}), fd)
    ls = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]])
    lt = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    y = torch.tensor([0, 1])
    outs = {"s": ls, "t": lt}
    apply = lambda params, x, slot=None: (None, outs[params])  # noqa: E731
    ctx = LocalContext(apply, {"model": "s", "mentor": "t"}, {}, {}, torch.zeros(2, 1), y, torch.ones(2))
    ce_s, ce_t = F.cross_entropy(ls, y), F.cross_entropy(lt, y)
    p_s, p_t = F.softmax(ls / 2, -1), F.softmax(lt / 2, -1)
    kl = lambda p, q: (p * (p.log() - q.log())).sum(-1).mean()  # noqa: E731
    want = ce_s + ce_t + (kl(p_t, p_s) + kl(p_s, p_t)) / (ce_s + ce_t)
    torch.testing.assert_close(fed.algo.loss(ctx), want)


def test_fedkd_without_distillation_or_compression_trains_the_mentee_as_fedavg(fd):
    a = train(make_cfg(algorithm={"name": "fedavg"}), fd)
    b = train(make_cfg(algorithm={"name": "fedkd", "distill": False, "svd": False}), fd)
    assert_trees_close(a.server["model"], b.server["model"], atol=1e-6, rtol=1e-5)


def test_fedkd_mentor_has_its_own_architecture_and_evaluates_the_personal_model(fd):
    fed = train(make_cfg(algorithm={"name": "fedkd", "mentor": "mlp", "mentor_options": {"hidden": 24}}), fd, rounds=2)
    g = fed.groups[0]
    assert g.store["mentor"]["body.0.weight"].shape[1] == 24 and fed.server["model"]["body.0.weight"].shape[0] == 8
    out = fed.evaluate(1)
    assert 0 <= out["personal"]["acc"] <= 1 and "global_clients" in out


def test_fedkd_bytes_up_count_the_kept_svd_components(fd):
    """payload_bytes_up = the dense tensors (biases) + per client and matrix k (m + n) floats, fewer than the dense update."""
    fed = build_federation(make_cfg(algorithm={"name": "fedkd", "t_start": 0.5, "t_end": 0.5}), fd)
    seen = {}
    aggregate = fed.algo.aggregate

    def spy(server, uploads, *a):
        seen["up"] = uploads
        return aggregate(server, uploads, *a)

    fed.algo.aggregate = spy
    rec = fed.round(0)
    up = seen["up"]
    want = sum(t.numel() * 4 for t in up["dense"].values())
    for k, u in up["u"].items():
        ranks = (u.abs().sum(-2) > 0).sum(-1)
        assert int(ranks.min()) >= 1 and int(ranks.max()) < min(u.shape[-2:])  # truncated
        want += int(ranks.sum()) * (u.shape[-2] + up["v"][k].shape[-1]) * 4
    assert rec["payload_bytes_up"] == want < 4 * len(ranks) * sum(t.numel() for t in fed.server["model"].values())
