"""The model-heterogeneous family: mixed architectures in one federation, the public stream and the logit exchange,
hand-computed losses of AHF and FCCL, the cross-client matrix, vectorized == sequential within each architecture
group and resume == uninterrupted."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fedtest import assert_trees_close, train, with_overrides

from fedmosaic.algorithms.ahf import ahf_loss
from fedmosaic.algorithms.fccl import cross_correlation_loss
from fedmosaic.data.federated import PartitionSpec, compute
from fedmosaic.engine.evaluate import cross_summary
from fedmosaic.errors import ConfigError
from fedmosaic.protocol.tree import leaves
from fedmosaic.runs.records import TIMING_KEYS, read_metrics
from fedmosaic.runs.runner import run
from fedmosaic.setup.world import build_federation

FAMILY = [{"name": "ahf"}, {"name": "ahf", "pd": "dissimilarity", "use_sd": False}, {"name": "fedmd"},
          {"name": "feddf", "tau": 2.0}, {"name": "rhfl"}, {"name": "fccl"}, {"name": "local"}]
N0 = 24


def make_cfg(**over):
    """Six blob clients, two MLP architectures of different widths (feature sizes 8 and 12), a noise stream."""
    raw = {
        "seed": 7,
        "data": {"dataset": "blobs", "clients": 6, "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_size": 5},
                 "client_test": 0.25, "public": {"source": "noise", "size": N0}},
        "model": {"heterogeneous": [{"name": "mlp", "options": {"hidden": 8}},
                                    {"name": "mlp", "options": {"hidden": [12, 12]}}]},
        "algorithm": {"name": "ahf"},
        "train": {"rounds": 3, "clients_per_round": 4, "local_epochs": 1, "batch_size": 8, "warmup_epochs": 1,
                  "optimizer": {"name": "adam", "lr": 0.01}},
        "eval": {"cross_clients": True},
        "checkpoint_every": 2,
    }
    return with_overrides(raw, **over)


@pytest.fixture(scope="module")
def fd(blob_data):
    spec = PartitionSpec("blobs", 6, {"scheme": "dirichlet", "alpha": 0.5, "min_size": 5}, "train", 0.25, 0.0, 7)
    return compute(spec, blob_data)


def strip_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


# ---- every method ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("algo", FAMILY, ids=lambda a: "-".join(map(str, a.values())))
def test_vectorized_equals_sequential_within_each_group(fd, algo):
    # SGD: FCCL's standardised logits give the head's bias a gradient that is exactly 0 up to rounding, which
    # Adam's normalisation turns into full steps of either sign (the backends then differ by 2 lr, legitimately)
    sgd = {"name": "sgd", "lr": 0.05}
    ref = train(make_cfg(algorithm=algo, engine={"backend": "sequential"}, train__optimizer=sgd), fd)
    vec = train(make_cfg(algorithm=algo, engine={"backend": "vectorized", "chunk_size": 3}, train__optimizer=sgd),
                fd)
    assert len(ref.groups) == 2
    for a, b in zip(ref.groups, vec.groups):
        assert_trees_close(a.store, b.store)
    np.testing.assert_allclose(ref.evaluate(2)["cross"]["matrix"], vec.evaluate(2)["cross"]["matrix"], atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("algo", FAMILY, ids=lambda a: "-".join(map(str, a.values())))
def test_resume_equals_uninterrupted(fd, algo, tmp_path):
    cfg = make_cfg(algorithm=algo, train__rounds=4, checkpoint_every=1)
    run(cfg, tmp_path / "full", progress=False, fd=fd)
    # killed after round 0, whose checkpoint holds the warmed-up models: the resume must not warm up again
    run(cfg, tmp_path / "cut", progress=False, fd=fd, stop_after=0)
    run(cfg, tmp_path / "cut", progress=False, fd=fd, resume=True)
    assert strip_timing(read_metrics(tmp_path / "cut")) == strip_timing(read_metrics(tmp_path / "full"))
    full = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert 0 < full["intra_last3"] <= 1 and 0 < full["inter_last3"] <= 1


# ---- the engine's pieces -------------------------------------------------------------------------------------
def test_clients_start_from_their_own_initialisation_and_warm_up(fd):
    own = build_federation(make_cfg(), fd)
    shared = build_federation(make_cfg(model__init="shared"), fd)
    for g_own, g_shared in zip(own.groups, shared.groups):
        w = leaves(g_own.store["model"])[0]
        assert not torch.equal(w[0], w[1])  # two clients of one architecture, two initialisations
        ws = leaves(g_shared.store["model"])[0]
        assert torch.equal(ws[0], ws[1])
    before = [leaves(g.store["model"])[0].clone() for g in own.groups]
    own.round(0)  # the warm-up runs first, for every client (here all are in the cohort or not: all change)
    for g, b in zip(own.groups, before):
        changed = (leaves(g.store["model"])[0] != b).flatten(1).any(1)
        assert changed.all()


def test_the_exchange_carries_every_cohort_clients_logits_and_bytes_count_them(fd):
    fed = build_federation(make_cfg(train__warmup_epochs=0), fd)
    seen = {}
    orig = fed.algo.exchange

    def spy(server, logits, clients, t):
        seen["logits"], seen["clients"] = logits, clients
        return orig(server, logits, clients, t)

    fed.algo.exchange = spy
    rec = fed.round(0)
    n, C = 4, fd.num_classes
    assert seen["logits"].shape == (n, N0, C)
    # the logits are each client's model on the public stream at the start of the round
    g = fed.groups[int(fed.group_of[int(seen["clients"][0])])]
    x = fed.transform(fed.public.x)
    k = int(seen["clients"][0])
    assert sorted(seen["clients"].tolist()) == sorted(set(seen["clients"].tolist()))
    rec_up = 4 * n * N0 * C  # float32 logits up; nothing else is uploaded by AHF
    assert rec["payload_bytes_up"] == rec_up
    assert rec["payload_bytes_down"] >= n * (rec_up + 8 * n)  # everybody's logits (and ids) down to every client
    fresh = build_federation(make_cfg(train__warmup_epochs=0), fd)
    row = int(fresh.row_of[k])
    params = {name: t[row] for name, t in fresh.groups[g.gid].store["model"].items()}
    _, logits = fresh.groups[g.gid].apply(params, x)
    assert torch.allclose(seen["logits"][0], logits, atol=1e-5)


def test_the_public_stream_is_the_same_batches_for_every_client(fd):
    fed = build_federation(make_cfg(), fd)
    trainer = fed.groups[0].trainer
    from fedmosaic.protocol.program import Phase, View

    plan = trainer._plan(trainer.public, np.array([0, 3, 5]), Phase(view=View("public"), batch=5), 0, 7, 2, ())
    rows = plan["rows"]
    assert torch.equal(rows[:, 0], rows[:, 1]) and torch.equal(rows[:, 0], rows[:, 2])
    assert sorted(rows[:, 0][plan["mask"][:, 0] > 0].tolist()) == list(range(N0))
    assert "draws" not in plan


def test_noise_is_uniform_in_the_data_range_and_seeded(fd):
    a, b = build_federation(make_cfg(), fd), build_federation(make_cfg(), fd)
    assert torch.equal(a.public.x, b.public.x)
    c = build_federation(make_cfg(data__public={"source": "noise", "size": N0, "seed": 99}), fd)
    assert not torch.equal(a.public.x, c.public.x)
    assert a.public.x.shape == (N0, *fd.dataset.input_shape)


def test_family_settings_are_one_line_errors(fd):
    with pytest.raises(ConfigError, match="warmup_epochs.*global model"):
        build_federation(make_cfg(model={"name": "mlp"}, algorithm={"name": "fedavg"}), fd)
    with pytest.raises(ConfigError, match="cross_clients.*no per-client models"):
        build_federation(make_cfg(model={"name": "mlp"}, algorithm={"name": "fedavg"}, train__warmup_epochs=0), fd)
    with pytest.raises(ConfigError, match="public stream: set data.public"):
        build_federation(make_cfg(data__public=None), fd)
    with pytest.raises(ConfigError, match="feature sizes differ.*project"):
        build_federation(make_cfg(algorithm={"name": "fedproto"}), fd)
    with pytest.raises(ConfigError, match="model.assign: one architecture index per client"):
        build_federation(make_cfg(model__assign=[0, 1]), fd)


def test_fedproto_runs_on_mixed_architectures_through_a_common_projection(fd):
    cfg = make_cfg(algorithm={"name": "fedproto"},
                   model={"heterogeneous": [{"name": "mlp", "options": {"hidden": 8, "project": 6}},
                                            {"name": "mlp", "options": {"hidden": [12, 12], "project": 6}}]})
    fed = train(cfg, fd)
    assert fed.server["protos"].shape == (fd.num_classes, 6)
    assert fed.evaluate(2)["cross"]["intra_avg"] > 0


def test_cross_summary_on_a_hand_example():
    correct = np.array([[8.0, 1, 0], [2, 9, 3], [0, 0, 5]])
    sizes = np.array([10, 10, 5])
    s = cross_summary(correct, sizes)
    assert s["matrix"][1] == [0.2, 0.9, 0.6]
    assert s["intra"] == [0.8, 0.9, 1.0]
    assert s["inter"] == pytest.approx([0.05, 0.4, 0.0])
    assert s["intra_avg"] == pytest.approx(0.9) and s["inter_avg"] == pytest.approx(0.15)
    # client 1 held out: the others' summary leaves its model and its split out; its own, apart, has no other
    trained = cross_summary(correct, sizes, np.array([True, False, True]))
    assert trained["inter"] == pytest.approx([0.0, 0.4, 0.0]) and trained["matrix"] == s["matrix"]
    assert trained["intra_avg"] == pytest.approx(0.9) and trained["inter_avg"] == pytest.approx(0.0)
    apart = cross_summary(correct, sizes, np.array([False, True, False]))
    assert apart["intra_avg"] == pytest.approx(0.9) and apart["inter_avg"] is None
    assert apart["inter"] == [pytest.approx(0.1), None, pytest.approx(0.0)]  # rows 0, 2 judged on client 1's split
    # a client whose split is the only tested one has no inter-domain accuracy: out of the mean, not a 0
    lone = cross_summary(correct, np.array([10, 0, 0]))
    assert lone["inter"][0] is None and lone["inter_avg"] == pytest.approx(np.mean([0.2, 0.0]))


# ---- hand-computed losses ----------------------------------------------------------------------------------------
def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _ahf_by_hand(student, Z, idx, k, use_pd=True, use_sd=True):
    """METHODS.md §5 written out with loops: client k, teachers i != k."""
    n, N0, _ = Z.shape
    V = Z[k].var(1)
    sd = 2 * (1 - (V - V.min()) / (V.max() - V.min()))
    total = 0.0
    for i in range(n):
        if i == k:
            continue
        cos = [Z[k, j] @ Z[i, j] / np.linalg.norm(Z[k, j]) / np.linalg.norm(Z[i, j]) for j in range(N0)]
        pd = max(np.mean(cos), 0.0) if use_pd else 1.0
        kls = []
        for b, j in enumerate(idx):
            p_i, p_k = _softmax(Z[i, j]), _softmax(student[b])
            kls.append((p_i * np.log(p_i / p_k)).sum() * (sd[j] if use_sd else 1.0))
        total += pd * np.mean(kls) / (n - 1)
    return total


def test_ahf_collaborative_loss_equals_a_hand_computed_value():
    g = np.random.default_rng(0)
    Z = g.normal(size=(3, 5, 4))
    Z[2] = Z[0] + 0.3 * g.normal(size=(5, 4))  # a teacher similar to client 0 (a positive PD)
    student, idx, k = g.normal(size=(3, 4)), np.array([4, 0, 2]), 0
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    own = torch.zeros(3, dtype=torch.float64)
    own[k] = 1
    for use_pd, use_sd in ((True, True), (True, False), (False, True), (False, False)):
        got = ahf_loss(t(student), t(Z), torch.as_tensor(idx), torch.ones(3, dtype=torch.float64), 1 - own, own,
                       use_pd=use_pd, use_sd=use_sd)
        assert float(got) == pytest.approx(_ahf_by_hand(student, Z, idx, k, use_pd, use_sd), rel=1e-10)


def test_ahf_without_pd_and_sd_is_the_mean_of_pairwise_kls():
    g = np.random.default_rng(1)
    Z, student = torch.as_tensor(g.normal(size=(4, 6, 3))), torch.as_tensor(g.normal(size=(6, 3)))
    own = torch.tensor([0.0, 1, 0, 0], dtype=torch.float64)
    got = ahf_loss(student, Z, torch.arange(6), torch.ones(6, dtype=torch.float64), 1 - own, own,
                   use_pd=False, use_sd=False)
    log_s = torch.log_softmax(student, -1)
    kls = [torch.nn.functional.kl_div(log_s, torch.log_softmax(Z[i], -1), log_target=True, reduction="batchmean")
           for i in (0, 2, 3)]
    assert float(got) == pytest.approx(float(sum(kls) / 3), rel=1e-10)


def test_fccl_cross_correlation_loss_equals_a_hand_computed_value():
    s = np.array([[1.0, 2.0], [3.0, -1.0], [0.0, 0.5]])
    t = np.array([[0.5, 1.0], [2.0, 0.0], [-1.0, 3.0]])

    def bn(a):  # the authors' (x - x.mean(0)) / x.std(0): torch's unbiased std, no eps
        return (a - a.mean(0)) / a.std(0, ddof=1)

    c = bn(s).T @ bn(t) / 3
    want = (c[0, 0] - 1) ** 2 + (c[1, 1] - 1) ** 2 + 0.0051 * ((c[0, 1] + 1) ** 2 + (c[1, 0] + 1) ** 2)
    got = cross_correlation_loss(torch.as_tensor(s), torch.as_tensor(t), torch.ones(3, dtype=torch.float64), 0.0051)
    assert float(got) == pytest.approx(want, rel=1e-10)
    # padding rows change nothing
    pad = cross_correlation_loss(torch.as_tensor(np.vstack([s, [[9.0, 9.0]]])),
                                 torch.as_tensor(np.vstack([t, [[7.0, -7.0]]])),
                                 torch.tensor([1.0, 1, 1, 0], dtype=torch.float64), 0.0051)
    assert float(pad) == pytest.approx(want, rel=1e-10)


# ---- the paper's architectures ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_resnet10_resnet12_mobilenetv2_and_efficientnet_b0_clients_train_and_evaluate_together():
    from fedmosaic.config import validate

    archs = [{"name": n, "options": {"width": 0.125}} for n in ("resnet10", "resnet12", "mobilenetv2",
                                                                 "efficientnet_b0")]
    cfg = validate({
        "seed": 2, "data": {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"}, "client_test": 0.2,
                            "public": {"source": "noise", "size": 32}},
        "model": {"heterogeneous": archs, "assign": [0, 1, 2, 3]},
        "algorithm": {"name": "ahf"},
        "train": {"rounds": 1, "clients_per_round": 4, "batch_size": 64, "warmup_epochs": 1,
                  "optimizer": {"name": "adam", "lr": 0.001}},
        "eval": {"cross_clients": True, "global_test": False}})
    fed = build_federation(cfg, None)
    assert [g.module.__class__.__name__ for g in fed.groups] == ["ResNet", "ResNet", "MobileNetV2", "EfficientNetB0"]
    assert sorted({g.module.feature_dim for g in fed.groups}) == [40, 64, 160]
    before = [leaves(g.store["model"])[-1].clone() for g in fed.groups]
    rec = fed.round(0)
    assert rec["payload_bytes_up"] == 4 * 4 * 32 * 10
    for g, b in zip(fed.groups, before):
        assert not torch.equal(leaves(g.store["model"])[-1], b)
    ev = fed.evaluate(0)
    m = np.array(ev["cross"]["matrix"])
    assert m.shape == (4, 4) and (m >= 0).all() and (m <= 1).all()
    assert ev["personal"]["acc_mean"] == pytest.approx(np.mean(np.diag(m)))


def test_feddf_with_one_architecture_is_ensemble_distillation_of_the_averaged_model(fd):
    from torch.func import functional_call

    common = {"model": {"name": "mlp", "options": {"hidden": 8}}, "train__warmup_epochs": 0, "train__rounds": 1,
              "eval": {}, "train__optimizer": {"name": "sgd", "lr": 0.05}}
    avg = train(make_cfg(algorithm={"name": "fedavg"}, **common), fd)
    fed = build_federation(make_cfg(algorithm={"name": "feddf_global", "public_batch": N0, "tau": 2.0}, **common), fd)
    seen = {}
    aggregate = fed.algo.aggregate

    def spy(server, uploads, *args):
        seen["uploads"] = uploads["model"]
        seen["average"] = aggregate(server, uploads, *args)["model"]
        return {**server, "model": seen["average"]}

    fed.algo.aggregate = spy
    fed.round(0)
    assert_trees_close(seen["average"], avg.server["model"], exact=True)  # the clients trained exactly as FedAvg's
    # by hand: one step (one batch holds the whole stream) of SGD on tau^2 KL(ensemble || student) from the average
    module, x, tau = fed.groups[0].module, fed.transform(fed.public.x), 2.0
    n = len(next(iter(seen["uploads"].values())))
    logits = [functional_call(module, {k: v[i] for k, v in seen["uploads"].items()}, (x,)) for i in range(n)]
    ens = torch.softmax(torch.stack(logits).mean(0) / tau, -1)  # the authors' avg_logits ensemble
    w = {k: v.clone().requires_grad_() for k, v in seen["average"].items()}
    log_s = torch.log_softmax(functional_call(module, w, (x,)) / tau, -1)
    loss = tau * tau * (ens * (ens.log() - log_s)).sum(-1).mean()
    grads = torch.autograd.grad(loss, list(w.values()))
    want = {k: (v - 0.05 * g).detach() for (k, v), g in zip(w.items(), grads)}
    assert_trees_close(fed.server["model"], want, atol=1e-6)
    assert not torch.equal(fed.server["model"]["fc.weight"], seen["average"]["fc.weight"])


def test_the_run_records_each_architectures_normalisation(fd, tmp_path):
    from fedmosaic.config import validate

    archs = [{"name": "resnet10", "options": {"width": 0.125, "norm": norm}} for norm in ("group", "batch")]
    cfg = validate({
        "seed": 2, "data": {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"}, "client_test": 0.2,
                            "public": {"source": "noise", "size": 16}},
        "model": {"heterogeneous": archs}, "algorithm": {"name": "fedmd"},
        "train": {"rounds": 1, "clients_per_round": 4, "batch_size": 64},
        "eval": {"cross_clients": True, "global_test": False}})
    with pytest.warns(UserWarning, match="has buffers"):  # BatchNorm: that group trains on the sequential path
        run(cfg, tmp_path / "r", progress=False)
    meta = json.loads((tmp_path / "r" / "meta.json").read_text())
    assert [(e["norm"], e["clients"]) for e in meta["execution"]] == [("group", 2), ("batch", 2)]
    assert meta["execution"][1]["backend"] == "sequential"


def test_uploads_of_different_architectures_must_share_a_layout(fd, monkeypatch):
    from fedmosaic.algorithms.local import Local

    # Local, made to upload its weights: an MLP of width 8 and one of 12-12 cannot be stacked
    monkeypatch.setattr(Local, "finish", lambda self, params, state, payload, stats: ({"w": params["model"]}, state))
    fed = build_federation(make_cfg(algorithm={"name": "local"}, data__public=None, train__warmup_epochs=0), fd)
    with pytest.raises(ConfigError, match="uploads differently shaped tensors from the different architectures"):
        fed.round(0)
