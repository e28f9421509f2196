"""FedPAC and FedKD against their authors' rules, computed by hand on tiny tensors (issue 19, items 1 and 4).

FedPAC: github.com/JianXu95/FedPAC (``methods/fedpac.py`` statistics_extraction, ``tools.py`` get_head_agg_weight,
``running.py`` train_round_fedpac). FedKD: github.com/wuch15/FedKD (``model_bert.py``, ``run.py``).
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fedtest import BLOBS6, assert_trees_close, blobs6_partition, with_overrides

from fedmosaic.algorithms.fedpac import collaboration_weights
from fedmosaic.protocol.context import LocalContext
from fedmosaic.protocol.program import Signals
from fedmosaic.protocol.tree import tmap
from fedmosaic.setup.world import build_federation


def make_cfg(**over):
    return with_overrides(copy.deepcopy(BLOBS6), **{"train__rounds": 4, **over})


@pytest.fixture(scope="module")
def fd(blob_data):
    return blobs6_partition(blob_data)


# ---- FedPAC ------------------------------------------------------------------------------------------------
def simplex_qp(Q: torch.Tensor) -> torch.Tensor:
    """argmin of a^T Q a over the simplex by brute force: for every support S the equality-constrained optimum
    a_S ∝ Q_S^{-1} 1, the best feasible one (Q positive definite: the true optimum is one of them)."""
    n, best = len(Q), None
    for r in range(1, n + 1):
        for S in map(list, itertools.combinations(range(n), r)):
            x = torch.linalg.solve(Q[S][:, S], torch.ones(r, dtype=Q.dtype))
            a = torch.zeros(n, dtype=Q.dtype)
            a[S] = x / x.sum()
            if bool((a >= 0).all()) and (best is None or a @ Q @ a < best @ Q @ best):
                best = a
    return best


def authors_qp(h: list, v: list) -> torch.Tensor:
    """The weights of every client as get_head_agg_weight builds them: P = diag(v) + [sum_c (h_i[c] − h_j1[c]) ·
    (h_i[c] − h_j2[c])]_{j1, j2}, its QP over the simplex, weights below 1e-3 dropped and the rest renormalised
    (agg_classifier_weighted_p divides by their sum)."""
    n, rows = len(h), []
    for i in range(n):
        P = torch.diag(torch.tensor(v, dtype=torch.float64))
        for j1, j2 in itertools.product(range(n), range(n)):
            P[j1, j2] += sum(float((h[i][c] - h[j1][c]) @ (h[i][c] - h[j2][c])) for c in range(len(h[i])))
        a = simplex_qp(P)
        a = a * (a > 1e-3)
        rows.append(a / a.sum())
    return torch.stack(rows)


def test_collaboration_weights_reach_the_qp_optimum_when_badly_conditioned():
    """Clients 1 and 2 almost alike, far from client 0, with tiny variances (the authors' V is divided by n_k: it is
    small): the split between them lies along a direction of curvature ~4e-4 against ~2 along others. The solver
    must reach the brute-force optimum (500 plain projected-gradient steps stopped 0.56 away)."""
    h = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 0.01]], dtype=torch.float64)[:, None, :]
    V = torch.tensor([1.0, 1e-4, 3e-4], dtype=torch.float64)
    flat = h.reshape(3, -1)
    diff = flat[None] - flat[:, None]
    Q = diff @ diff.transpose(1, 2) + torch.diag(V)
    want = torch.stack([simplex_qp(Q[i]) for i in range(3)])
    torch.testing.assert_close(collaboration_weights(h, V), want, atol=1e-6, rtol=0)
    # the 1e-3 cut: rows 1 and 2 give client 0 a weight of ~4e-5 and ~3e-5, dropped, the rest renormalised
    cut = want * (want > 1e-3)
    torch.testing.assert_close(collaboration_weights(h, V, cut=1e-3), cut / cut.sum(1, keepdim=True), atol=1e-6,
                               rtol=0)


@pytest.mark.cpu
def test_fedpac_heads_combine_by_the_authors_variance_and_bias(fd):
    """Three clients' features given per sample; V_k, h_k and the weights computed as the authors' loops do
    (V_k = [sum_c p_c tr(F_c^T F_c) / n_c − sum_c p_c^2 ||mu_c||^2] / n_k); each new head = those weights applied to
    the uploaded heads. (The previous code used p_c for p_c^2 and no / n_k: it mixed far more of the others.)"""
    fed = build_federation(make_cfg(algorithm={"name": "fedpac"}), fd)
    algo, server = fed.algo, fed.server
    C, d = algo.num_classes, algo.feature_dim
    g = torch.Generator().manual_seed(1)
    labels = [[0, 0, 1, 1, 1], [0, 1, 1, 2, 2, 2, 2], [2, 2, 1]]
    feats = [torch.randn(len(y), d, generator=g) + torch.tensor(y, dtype=torch.float32)[:, None] for y in labels]
    h, v = [], []
    for z, y in zip(feats, labels, strict=True):
        y = torch.tensor(y)
        n_k, h_k, v_k = len(y), torch.zeros(C, d, dtype=torch.float64), 0.0
        for c in y.unique().tolist():
            F_c = z[y == c].double()
            p_c, mu_c = len(F_c) / n_k, F_c.mean(0)
            h_k[c] = p_c * mu_c
            v_k += p_c * float(torch.trace(F_c.T @ F_c / len(F_c))) - p_c**2 * float(mu_c @ mu_c)
        h.append(h_k)
        v.append(v_k / n_k)
    alpha = authors_qp(h, v)
    assert float(alpha.diagonal().min()) < 0.9  # the heads do mix
    onehot = [F.one_hot(torch.tensor(y), C).float() for y in labels]
    heads = {k: torch.randn(3, *t.shape[1:], generator=g) for k, t in server["heads"].items()}
    ups = {"body": {k: t[None].repeat(3, *([1] * t.dim())) for k, t in server["model"].items() if k not in heads},
           "head": heads, "count": torch.stack([o.sum(0) for o in onehot]),
           "h_sum": torch.stack([o.T @ z for o, z in zip(onehot, feats, strict=True)]),
           "sq": torch.stack([(z * z).sum() for z in feats])}
    ups["sum"] = ups["h_sum"]
    new = algo.aggregate(server, ups, torch.tensor([5.0, 7.0, 3.0]), 0, Signals(torch.tensor([2, 0, 5]),
                                                                                torch.zeros(3), torch.ones(3), 0.1))
    for k, t in heads.items():
        want = torch.einsum("ij,j...->i...", alpha.float(), t)
        torch.testing.assert_close(new["heads"][k][[2, 0, 5]], want, atol=1e-5, rtol=1e-5)


def test_fedpac_statistics_are_taken_at_the_received_model(fd):
    """h and V come from one pass over the client's data at the model it received (the global body, its own head),
    before local training; the centroid sums from one pass at its final model."""
    fed = build_federation(make_cfg(algorithm={"name": "fedpac"}), fd)
    fed.round(0)  # (heads of their own, centroids on the server)
    g, algo = fed.groups[0], fed.algo
    clients = np.array([0, 3])
    own = fed.own(clients)
    up = g.trainer.train(fed.split["train"], clients, algo.broadcast(fed.server, 1), tmap(lambda t: t[:2], g.store),
                         {}, own=own, lr=0.1, seed=0, round_idx=1, program=algo.program(1),
                         probes=algo.probes(1, fed.algo.broadcast(fed.server, 1)))[0]
    tr = fed.split["train"]
    body = {k: v for k, v in fed.server["model"].items() if k not in own["head"]}
    for i, k in enumerate(clients):
        x, y = tr.x[tr.ptr[k] : tr.ptr[k + 1]], tr.y[tr.ptr[k] : tr.ptr[k + 1]]
        onehot = F.one_hot(y, algo.num_classes).float()
        z0, _ = g.apply({**body, **tmap(lambda t, i=i: t[i], own["head"])}, x)  # received
        z1, _ = g.apply({**tmap(lambda t, i=i: t[i], up["body"]), **tmap(lambda t, i=i: t[i], up["head"])}, x)
        torch.testing.assert_close(up["h_sum"][i], onehot.T @ z0, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(up["sq"][i], (z0 * z0).sum(), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(up["count"][i], onehot.sum(0))
        torch.testing.assert_close(up["sum"][i], onehot.T @ z1, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(z0, z1, atol=1e-3)  # training moved the features: the two passes differ


@pytest.mark.cpu
def test_fedpac_a_class_absent_from_the_cohort_keeps_no_stale_centroid(fd):
    """The server's centroids are this round's cohort's: a class nobody in it has loses its centroid (the
    authors' server replaces its centroid dict every round), so the next round aligns no sample of it."""
    fed = build_federation(make_cfg(algorithm={"name": "fedpac"}), fd)
    algo = fed.algo
    C, d = algo.num_classes, algo.feature_dim
    server = {**fed.server, "protos": torch.ones(C, d), "has": torch.ones(C)}  # every class had one before
    count = torch.tensor([[2.0, 0, 1, 0, 4], [1, 3, 0, 0, 2]])[:, :C]  # class 3: nobody this round
    sums = torch.randn(2, C, d) * (count > 0)[..., None]
    heads = {k: t[:2].clone() for k, t in server["heads"].items()}
    body = {k: v[None].repeat(2, *([1] * v.dim())) for k, v in server["model"].items() if k not in heads}
    ups = {"body": body, "head": heads, "sum": sums, "h_sum": sums, "count": count, "sq": torch.tensor([5.0, 7.0])}
    new = algo.aggregate(server, ups, torch.tensor([3.0, 4.0]), 0,
                         Signals(torch.tensor([4, 1]), torch.zeros(2), torch.ones(2), 0.1))
    want_has = (count.sum(0) > 0).float()
    assert new["has"].tolist() == want_has.tolist() and new["has"][3] == 0
    torch.testing.assert_close(new["protos"][3], torch.zeros(d))
    torch.testing.assert_close(new["protos"][0], (sums[0, 0] + sums[1, 0]) / 3)


def test_fedpac_head_learning_rate_is_its_own(fd):
    """head_lr = 0.3 at a round learning rate of 0.1 trains the head exactly as the round's rate 0.3 does, and the
    body exactly as 0.1 does."""
    def first_round(lr, head_lr):
        fed = build_federation(make_cfg(algorithm={"name": "fedpac", "head_lr": head_lr}, train__optimizer__lr=lr), fd)
        g, algo, clients = fed.groups[0], fed.algo, np.array([0, 3])
        return g.trainer.train(fed.split["train"], clients, algo.broadcast(fed.server, 0),
                               tmap(lambda t: t[:2], g.store), {}, own=fed.own(clients), lr=lr, seed=0,
                               round_idx=0, program=algo.program(0)[:1],
                               probes=algo.probes(0, algo.broadcast(fed.server, 0)))[0]

    own_rate, fast, slow = first_round(0.1, 0.3), first_round(0.3, None), first_round(0.1, None)
    assert_trees_close(own_rate["head"], fast["head"], exact=True)
    assert not torch.equal(own_rate["head"]["fc.weight"], slow["head"]["fc.weight"])


# ---- FedKD -------------------------------------------------------------------------------------------------
def kd_context(ls, lt, y, mask):
    outs = {"s": ls, "t": lt}
    apply = lambda params, x, slot=None: (None, outs[params])
    return LocalContext(apply, {"model": "s", "mentor": "t"}, {}, {}, torch.zeros(len(y), 1), y, mask)


@pytest.mark.filterwarnings("ignore:reduction")  # torch's note that "mean" is not "batchmean": the point here
def test_fedkd_distillation_is_the_authors_element_mean(fd):
    """Default: each KL as nn.KLDivLoss() computes it in the authors' model_bert.py — sum over the B x C entries
    divided by B·C, i.e. 1/C of the per-sample KL — over the real samples (the third one is padding), weighted
    by 1 / (L_s + L_t); kd_reduction: sample is C times that."""
    ls = torch.tensor([[2.0, 0.0, -1.0, 0.3], [0.5, 0.5, 0.0, -0.2], [9.0, -9.0, 9.0, 0.0]])
    lt = torch.tensor([[1.0, 1.0, 0.0, 0.1], [0.0, 2.0, 1.0, 0.0], [-9.0, 9.0, 0.0, 0.0]])
    y, mask = torch.tensor([0, 1, 2]), torch.tensor([1.0, 1.0, 0.0])
    real_s, real_t, real_y = ls[:2], lt[:2], y[:2]
    ce_s, ce_t = F.cross_entropy(real_s, real_y), F.cross_entropy(real_t, real_y)
    kl_div = torch.nn.KLDivLoss()  # reduction "mean": the authors' criterion2
    p_s, p_t = F.softmax(real_s, -1), F.softmax(real_t, -1)
    kd_mentee = kl_div(F.log_softmax(real_s, -1), p_t)  # = sum p_t (log p_t − log p_s) / (2 · 4)
    torch.testing.assert_close(kd_mentee, (p_t * (p_t.log() - p_s.log())).sum() / 8)
    kd_mentor = kl_div(F.log_softmax(real_t, -1), p_s)
    want = ce_s + ce_t + (kd_mentee + kd_mentor) / (ce_s + ce_t)
    fed = build_federation(make_cfg(algorithm={"name": "fedkd"}), fd)
    ctx = kd_context(ls, lt, y, mask)
    torch.testing.assert_close(fed.algo.loss(ctx), want)
    assert set(ctx.terms) == {"ce_mentee", "ce_mentor", "kd_mentee", "kd_mentor"}
    torch.testing.assert_close(ctx.terms["kd_mentee"], kd_mentee / (ce_s + ce_t))
    per_sample = build_federation(make_cfg(algorithm={"name": "fedkd", "kd_reduction": "sample"}), fd)
    want = ce_s + ce_t + 4 * (kd_mentee + kd_mentor) / (ce_s + ce_t)
    torch.testing.assert_close(per_sample.algo.loss(kd_context(ls, lt, y, mask)), want)


def test_fedkd_svd_energy_follows_the_authors_schedule(fd):
    """run.py: energy = tmin + (1 + round) / rounds · (tmax − tmin), round counted from 0: above t_start already in
    the first round, t_end in the last."""
    fed = build_federation(make_cfg(algorithm={"name": "fedkd", "t_start": 0.9, "t_end": 0.98}), fd)
    got = [float(fed.algo.broadcast(fed.server, r)["energy"]) for r in range(4)]
    assert got == pytest.approx([0.9 + (r + 1) / 4 * 0.08 for r in range(4)])
