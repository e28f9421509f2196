"""Issue 19, items 8-10: FCCL, RHFL and FedDF against their authors' rules, each computed by hand on tiny tensors
(FCCL: github.com/WenkeHuang/FCCL fccl/Idea/Ours/FCCL.py + utils_idea.py; RHFL: github.com/FangXiuwen/Robust_FL
RHFL/HHF/HHF.py + loss.py; FedDF: github.com/epfml/federated-learning-public-code codes/FedDF-code)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fedtest import with_overrides
from torch.func import functional_call

from fedmosaic.algorithms.fccl import FCCL, FCCLConfig, cross_correlation_loss
from fedmosaic.algorithms.feddf import FedDF, FedDFConfig
from fedmosaic.algorithms.rhfl import RHFL, RHFLConfig, sce_parts
from fedmosaic.data.federated import PartitionSpec, compute
from fedmosaic.errors import ConfigError
from fedmosaic.protocol.context import LocalContext
from fedmosaic.setup.world import build_federation

D = torch.float64


def make_cfg(**over):
    """Six blob clients, two MLP architectures, a noise stream of 24, one warm-up epoch."""
    raw = {
        "seed": 7,
        "data": {"dataset": "blobs", "clients": 6, "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_size": 5},
                 "client_test": 0.25, "public": {"source": "noise", "size": 24}},
        "model": {"heterogeneous": [{"name": "mlp", "options": {"hidden": 8}},
                                    {"name": "mlp", "options": {"hidden": [12, 12]}}]},
        "algorithm": {"name": "fccl"},
        "train": {"rounds": 2, "clients_per_round": 4, "local_epochs": 1, "batch_size": 8, "warmup_epochs": 1,
                  "optimizer": {"name": "adam", "lr": 0.01}},
    }
    return with_overrides(raw, **over)


@pytest.fixture(scope="module")
def fd(blob_data):
    spec = PartitionSpec("blobs", 6, {"scheme": "dirichlet", "alpha": 0.5, "min_size": 5}, "train", 0.25, 0.0, 7)
    return compute(spec, blob_data)


def softmax(z, tau=1.0):
    e = np.exp(z / tau - (z / tau).max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def kl(p, q):  # per row KL(p || q)
    return (p * (np.log(p) - np.log(q))).sum(-1)


def linear_ctx(w, x, y=None, state=None, payload=None):
    """A LocalContext of a linear model (logits = x @ params["w"]) on one batch of real samples."""

    def apply(params, xb, slot=None):
        return xb, xb @ params["w"]

    mask = torch.ones(len(x), dtype=D)
    return LocalContext(apply, {"model": {"w": w}}, state or {}, payload or {}, x,
                        y if y is not None else torch.arange(len(x)), mask)


# ---- FCCL (item 8) ---------------------------------------------------------------------------------------
def test_fccl_standardises_with_the_unbiased_std_and_divides_by_the_batch():
    s = np.array([[1.0, 2.0, 0.3], [3.0, -1.0, 0.1], [0.0, 0.5, -2.0], [2.0, 2.5, 1.0]])
    t = np.array([[0.5, 1.0, 2.0], [2.0, 0.0, -1.0], [-1.0, 3.0, 0.0], [0.3, -0.2, 0.7]])

    def z(a):  # the authors' (x - x.mean(0)) / x.std(0): torch's std is unbiased (ddof 1), no eps
        return (a - a.mean(0)) / a.std(0, ddof=1)

    c = z(s).T @ z(t) / 4  # c.div_(len(images))
    off = ~np.eye(3, dtype=bool)
    want = ((np.diag(c) - 1) ** 2).sum() + 0.0051 * ((c[off] + 1) ** 2).sum()
    got = cross_correlation_loss(torch.as_tensor(s), torch.as_tensor(t), torch.ones(4, dtype=D), 0.0051)
    assert float(got) == pytest.approx(want, rel=1e-10)


def test_fccl_public_target_is_the_mean_of_the_whole_cohort_own_round_start_logits_included():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 3, generator=g, dtype=D), torch.randn(3, 4, generator=g, dtype=D)
    Z = torch.randn(3, 7, 4, generator=g, dtype=D)  # three clients' round-start logits on a stream of 7
    idx = torch.tensor([6, 0, 3, 2, 5])
    algo = FCCL(FCCLConfig())
    payload = {**algo.exchange({}, Z, torch.tensor([4, 1, 2]), 0), "own": {"cid": torch.tensor(1)}}
    got = algo.collaborate(linear_ctx(w, x, idx, payload=payload))
    # the authors: mean over all N of (the others' outputs, the client's own previous-round model's)
    t = Z.mean(0)[idx].numpy()
    s = (x @ w).numpy()
    zs, zt = (s - s.mean(0)) / s.std(0, ddof=1), (t - t.mean(0)) / t.std(0, ddof=1)
    c = zs.T @ zt / 5
    want = ((np.diag(c) - 1) ** 2).sum() + 0.0051 * ((c[~np.eye(4, dtype=bool)] + 1) ** 2).sum()
    assert float(got) == pytest.approx(want, rel=1e-9)


def test_fccl_private_teachers_are_the_previous_round_model_and_the_frozen_warm_up_model():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 3, generator=g, dtype=D), torch.tensor([0, 1, 2, 3, 1, 0])
    w, prev, pre, snap = (torch.randn(3, 4, generator=g, dtype=D) for _ in range(4))
    ctx = linear_ctx(w, x, y, state={"model": {"w": prev}, "pre": {"w": pre}})
    ctx.params["snap"] = {"w": snap}  # the model after this round's public phase: not a teacher
    got = FCCL(FCCLConfig(tau=2.0)).local_loss(ctx)
    s = (x @ w).numpy()
    ce = -np.log(softmax(s))[np.arange(6), y.numpy()].mean()
    kd = [kl(softmax((x @ m).numpy(), 2.0), softmax(s, 2.0)).mean() for m in (prev, pre)]  # KLDivLoss batchmean
    assert float(got) == pytest.approx(ce + 4.0 * (kd[0] + kd[1]), rel=1e-9)
    assert set(ctx.terms) == {"task_loss", "inter_kl", "intra_kl"}


def test_fccl_private_phase_distils_from_the_model_the_client_started_the_round_from(fd):
    fed = build_federation(make_cfg(engine={"backend": "sequential"}), fd)
    fed.round(0)
    start = {g.gid: {k: v.clone() for k, v in g.store["model"].items()} for g in fed.groups}
    pre = {g.gid: {k: v.clone() for k, v in g.store["pre"].items()} for g in fed.groups}
    checked = []
    local_loss = fed.algo.local_loss

    def by_hand(ctx):  # CE + KL(round-start model || model) + KL(warm-up model || model), on this batch
        k = int(ctx.payload["own"]["cid"])
        g, row = fed.groups[int(fed.group_of[k])], int(fed.row_of[k])
        real = ctx.mask > 0
        x, y, s = ctx.x[real], ctx.y[real], ctx.forward()[1][real].detach()
        log_s = torch.log_softmax(s, -1)
        want = -log_s[torch.arange(len(y)), y].mean()
        for m in (start, pre):
            log_t = torch.log_softmax(functional_call(g.module, {n: v[row] for n, v in m[g.gid].items()}, (x,)), -1)
            want = want + (log_t.exp() * (log_t - log_s)).sum(-1).mean()
        got = local_loss(ctx)
        checked.append(float(got.detach() - want))
        return got

    fed.algo.local_loss = by_hand
    fed.round(1)
    assert checked and max(map(abs, checked)) < 1e-5


def test_fccl_without_warm_up_is_a_one_line_error_before_anything_is_written():
    with pytest.raises(ConfigError, match=r"warmup_epochs: 'fccl'.*random model.*at least 1"):
        make_cfg(algorithm={"name": "fccl"}, train__warmup_epochs=0)  # refused by config validation


# ---- RHFL (item 9) ---------------------------------------------------------------------------------------
def test_rhfl_symmetric_ce_with_the_authors_clipping():
    logits = torch.tensor([[20.0, 0.0, -5.0], [0.3, 0.1, 0.2]], dtype=D)  # row 0: p_2 < 1e-7, clipped
    y = torch.tensor([0, 2])
    ce, rce = sce_parts(logits, y)
    p = np.clip(softmax(logits.numpy()), 1e-7, 1.0)
    q = np.clip(np.eye(3)[y.numpy()], 1e-4, 1.0)
    np.testing.assert_allclose(rce.numpy(), -(p * np.log(q)).sum(1), rtol=1e-12)
    np.testing.assert_allclose(ce.numpy(), -np.log(softmax(logits.numpy()))[[0, 1], y.numpy()], atol=1e-14)


def test_rhfl_confidence_weights_as_the_authors_formula_and_the_guard():
    algo = RHFL(RHFLConfig())
    ids = torch.tensor([0, 1, 2, 3])
    q = np.array([0.2, 0.1, -0.05, 0.15])
    w = algo.exchange({"q": torch.as_tensor(q)}, torch.zeros(4, 2, 3), ids, 5)["w"].numpy()
    a = 1 / 3 + 0.5 * q / q.sum()
    np.testing.assert_allclose(w, np.exp(a) / np.exp(a).sum(), rtol=1e-12)
    # no drop yet (round 0) or a cohort whose losses rose in total: every weight 1/(N-1), the authors' round 0
    for bad in ([0.0, 0.0, 0.0, 0.0], [0.1, -0.2, 0.05, 0.0]):
        w = algo.exchange({"q": torch.tensor(bad)}, torch.zeros(4, 2, 3), ids, 5)["w"].numpy()
        np.testing.assert_allclose(w, np.full(4, 1 / 3))
    w = RHFL(RHFLConfig(min_total_drop=0.5)).exchange({"q": torch.as_tensor(q)}, torch.zeros(4, 2, 3), ids, 5)["w"]
    np.testing.assert_allclose(w.numpy(), np.full(4, 1 / 3))  # the guard's threshold is an option (sum q = 0.4)


def test_rhfl_public_loss_weighs_each_peer_by_its_share_of_the_softmax_over_all():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 3, generator=g, dtype=D), torch.randn(3, 5, generator=g, dtype=D)
    Z = torch.randn(3, 6, 5, generator=g, dtype=D)
    idx = torch.tensor([5, 1, 0, 3])
    weights = torch.tensor([0.5, 0.2, 0.3], dtype=D)
    payload = {"logits": Z, "clients": torch.tensor([7, 2, 4]), "w": weights, "own": {"cid": torch.tensor(2)}}
    got = RHFL(RHFLConfig()).collaborate(linear_ctx(w, x, idx, payload=payload))
    s = softmax((x @ w).numpy())
    want = sum(float(weights[j]) * kl(softmax(Z[j, idx].numpy()), s).mean() for j in (0, 2))
    assert float(got) == pytest.approx(want, rel=1e-9)


@pytest.mark.cpu
def test_rhfl_reweights_from_round_one_with_the_drop_of_the_symmetric_ce_over_the_round(fd):
    cfg = make_cfg(algorithm={"name": "rhfl"}, train__clients_per_round=6, engine={"backend": "sequential"})
    fed = build_federation(cfg, fd)
    sent, models = [], []
    exchange = fed.algo.exchange

    def spy(server, logits, clients, t):
        models.append([{k: v.clone() for k, v in g.store["model"].items()} for g in fed.groups])
        out = exchange(server, logits, clients, t)
        sent.append((clients.tolist(), out["w"].clone()))
        return out

    fed.algo.exchange = spy
    fed.round(0)
    fed.round(1)

    def sce_mean(k, params):  # the authors' SCELoss(alpha=0.1, beta=1.0) on the client's private data
        g = fed.groups[int(fed.group_of[k])]
        rows = slice(int(fed.split["train"].ptr[k]), int(fed.split["train"].ptr[k + 1]))
        x, y = fed.transform(fed.split["train"].x[rows]), fed.split["train"].y[rows]
        p = torch.softmax(functional_call(g.module, params, (x,)), -1).double()
        ce = -p.log()[torch.arange(len(y)), y]
        rce = -np.log(1e-4) * (p.clamp(min=1e-7).sum(1) - p.clamp(min=1e-7)[torch.arange(len(y)), y])
        return float((0.1 * ce + rce).mean())

    def params_of(snapshot, k):
        g = fed.groups[int(fed.group_of[k])]
        return {n: v[int(fed.row_of[k])] for n, v in snapshot[g.gid].items()}

    clients, w = sent[1]
    L = {k: (sce_mean(k, params_of(models[0], k)), sce_mean(k, params_of(models[1], k))) for k in clients}
    q = np.array([(L[k][0] - L[k][1]) / L[k][1] for k in clients])
    assert q.sum() > 1e-6  # (the guard is not what this checks)
    a = 1 / (len(clients) - 1) + 0.5 * q / q.sum()
    np.testing.assert_allclose(w.numpy(), np.exp(a) / np.exp(a).sum(), rtol=1e-4)
    np.testing.assert_allclose(sent[0][1].numpy(), 1 / (len(clients) - 1))  # round 0: the authors' uniform weights


# ---- FedDF (item 10) -------------------------------------------------------------------------------------
@pytest.mark.parametrize("teacher", ["logits", "probs"])
def test_feddf_ensemble_and_the_tau_squared_kl(teacher):
    g = torch.Generator().manual_seed(3)
    Z = torch.randn(3, 6, 4, generator=g, dtype=D) * 3
    x, w = torch.randn(4, 2, generator=g, dtype=D), torch.randn(2, 4, generator=g, dtype=D)
    idx = torch.tensor([2, 5, 0, 1])
    algo = FedDF(FedDFConfig(tau=2.0, teacher=teacher))
    payload = algo.exchange({}, Z, torch.arange(3), 0)
    z = Z.numpy()
    # the authors' avg_logits: softmax(mean_k z_k / T); avg_probs: mean_k softmax(z_k / T)
    ens = softmax(z.mean(0), 2.0) if teacher == "logits" else softmax(z, 2.0).mean(0)
    np.testing.assert_allclose(payload["ensemble"].numpy(), ens, rtol=1e-12)
    got = algo.collaborate(linear_ctx(w, x, idx, payload=payload))
    want = 4.0 * kl(ens[idx.numpy()], softmax((x @ w).numpy(), 2.0)).mean()  # tau^2 = 4 (the authors: tau = 1)
    assert float(got) == pytest.approx(want, rel=1e-9)


def test_feddf_default_teacher_is_the_authors_averaged_logits():
    Z = torch.tensor([[[4.0, 0.0]], [[-1.0, 1.0]]], dtype=D)  # mean logits (1.5, 0.5); mean softmax differs
    got = FedDF(FedDFConfig()).exchange({}, Z, torch.arange(2), 0)["ensemble"].numpy()
    np.testing.assert_allclose(got, softmax(np.array([[1.5, 0.5]])), rtol=1e-12)
