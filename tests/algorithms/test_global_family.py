"""The global-model family of METHODS.md §3: FedNTD, FedCurv, SCAFFOLD, FedNova, MOON, FedAvgM.

Hand-computed terms, reductions to FedAvg, server/client bookkeeping checked against formulas written out here, and
vectorized ≡ sequential.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from fedtest import assert_trees_close, train

from fedmosaic.algorithms.fednova import local_step_normaliser
from fedmosaic.algorithms.terms import ControlVariate, CurvaturePenalty, ModelContrastive, NotTrueDistillation
from fedmosaic.config import validate
from fedmosaic.data.federated import PartitionSpec, compute
from fedmosaic.engine.client.optim import OptimizerConfig
from fedmosaic.protocol.context import LocalContext
from fedmosaic.protocol.tree import leaves, tmap
from fedmosaic.setup.world import build_federation

DIRICHLET = {"scheme": "dirichlet", "alpha": 0.5, "min_size": 5}


def make_cfg(algorithm, clients=8, partition=DIRICHLET, client_test=0.25, model=None, rounds=2, per_round=5,
             epochs=2, batch=8, optimizer=None, **engine):
    return validate({
        "seed": 3,
        "data": {"dataset": "blobs", "clients": clients, "partition": partition, "client_test": client_test},
        "model": model or {"name": "mlp", "options": {"hidden": 16}},
        "algorithm": algorithm,
        "train": {"rounds": rounds, "clients_per_round": per_round, "local_epochs": epochs, "batch_size": batch,
                  "optimizer": optimizer or {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}},
        "engine": engine,
    })


def partition(blob_data, clients, scheme, client_test):
    return compute(PartitionSpec("blobs", clients, scheme, "train", client_test, 0.0, 3), blob_data)


@pytest.fixture(scope="module")
def fd(blob_data):
    return partition(blob_data, 8, DIRICHLET, 0.25)


@pytest.fixture(scope="module")
def fd_iid(blob_data):
    return partition(blob_data, 6, {"scheme": "iid"}, 0.0)  # 600 / 6: every client holds 100 samples


@pytest.fixture(scope="module")
def fd3(blob_data):
    return partition(blob_data, 3, DIRICHLET, 0.0)





def spy_aggregate(fed):
    """Record (server before, uploads, weights) of every aggregation."""
    calls = []
    orig = fed.algo.aggregate

    def spy(server, uploads, weights, t, signals):
        calls.append((tmap(torch.clone, server), tmap(torch.clone, uploads), weights.clone()))
        return orig(server, uploads, weights, t, signals)

    fed.algo.aggregate = spy
    return calls


def spy_cohorts(fed):
    """Record the clients each round trains (one architecture group)."""
    cohorts = []
    tr = fed.groups[0].trainer
    orig = tr.train

    def spy(data, clients, *args, **kw):
        cohorts.append(np.asarray(clients).copy())
        return orig(data, clients, *args, **kw)

    tr.train = spy
    return cohorts


# ---- terms --------------------------------------------------------------------------------------


def logits_ctx(student, teacher, y, mask, state=None, payload=None):
    """A context whose "model" outputs ``student`` logits (and features) whatever the input."""
    apply = lambda params, x, slot=None: (params["z"], params["logits"])
    params = {"model": {"z": student, "logits": student}}
    payload = {"global": {"z": teacher, "logits": teacher}, **(payload or {})}
    return LocalContext(apply, params, state or {}, payload, torch.zeros(len(y), 1), y, mask)


def softmax(v):
    e = [math.exp(a) for a in v]
    return [a / sum(e) for a in e]


def test_not_true_distillation_matches_hand_computation():
    s = torch.tensor([[1.0, 2.0, 0.5, -0.3], [0.2, -1.0, 1.5, 0.7], [9.0, -9.0, 3.0, 0.0]], requires_grad=True)
    t = torch.tensor([[0.3, 1.0, -0.5, 0.8], [2.0, 0.0, 1.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    y = torch.tensor([1, 0, 2])
    mask = torch.tensor([1.0, 1.0, 0.0])  # the third sample is padding
    beta, tau = 0.5, 2.0
    loss = NotTrueDistillation(beta, tau)(logits_ctx(s, t, y, mask))

    # by hand: drop the true column, softmax(./tau) over the other three, tau^2 KL(teacher || student), batch mean
    kls = []
    rows = (([1.0, 2.0, 0.5, -0.3], [0.3, 1.0, -0.5, 0.8], 1), ([0.2, -1.0, 1.5, 0.7], [2.0, 0.0, 1.0, -1.0], 0))
    for srow, trow, yi in rows:
        q = softmax([v / tau for c, v in enumerate(srow) if c != yi])
        p = softmax([v / tau for c, v in enumerate(trow) if c != yi])
        kls.append(tau**2 * sum(pc * math.log(pc / qc) for pc, qc in zip(p, q)))
    expected = beta * (kls[0] + kls[1]) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)

    (g,) = torch.autograd.grad(loss, s)
    assert g[0, 1] == 0 and g[1, 0] == 0  # the true-class logit gets exactly no gradient
    assert torch.equal(g[2], torch.zeros(4))  # nor does padding
    assert (g[0, [0, 2, 3]] != 0).all() and (g[1, 1:] != 0).all()
    assert NotTrueDistillation(0.0)(logits_ctx(s, t, y, mask)).item() == 0


def test_not_true_distillation_is_zero_when_student_equals_teacher_on_not_true_classes():
    s = torch.tensor([[1.0, 2.0, 0.5], [0.2, -1.0, 1.5]])
    t = s + torch.tensor([[0.0, 5.0, 0.0], [-3.0, 0.0, 0.0]])  # differ only in the true class (and a shift)
    t[1] += 0.7
    y = torch.tensor([1, 0])
    loss = NotTrueDistillation(1.0, 3.0)(logits_ctx(s, t, y, torch.ones(2)))
    assert abs(loss.item()) < 1e-6


def test_curvature_penalty_uses_the_other_clients_sums():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    state = {"u": {"w": torch.tensor([1.0, 1.0])}, "v": {"w": torch.tensor([0.25, 0.5])}}
    payload = {"U": {"w": torch.tensor([3.0, 5.0])}, "V": {"w": torch.tensor([0.5, 1.0])}}
    ctx = LocalContext(None, {"model": {"w": w}}, state, payload, None, None, None)
    loss = CurvaturePenalty(2.0)(ctx)
    # P = U - u = [2, 4], Q = V - v = [0.25, 0.5]: lam <P, (w - Q/P)^2> = 2 * (2 * 0.875^2 + 4 * 1.875^2) = 31.1875
    # (the paper's 2 * (2*1 + 4*4 - 2 * (0.25*1 + 0.5*2)) = 31 plus its minimum's depth 2 * (0.25^2/2 + 0.5^2/4))
    assert loss.item() == pytest.approx(31.1875)
    (g,) = torch.autograd.grad(loss, w)  # 2 lam (P w - Q)
    torch.testing.assert_close(g, torch.tensor([7.0, 30.0]))
    at_min = {"model": {"w": torch.tensor([0.125, 0.125])}}  # Q / P: the penalty's minimum is 0, not negative
    assert CurvaturePenalty(2.0)(LocalContext(None, at_min, state, payload, None, None, None)).item() == 0


def test_control_variate_gradient_is_c_minus_ci():
    w = {"a": torch.randn(3, 2, requires_grad=True), "b": torch.randn(2, requires_grad=True)}
    c = {"a": torch.randn(3, 2), "b": torch.randn(2)}
    ci = {"a": torch.randn(3, 2), "b": torch.randn(2)}
    ctx = LocalContext(None, {"model": w}, {"c": ci}, {"c": c}, None, None, None)
    value = ControlVariate()(ctx)
    assert value.item() == 0  # only its gradient matters: the reported loss stays the task loss
    grads = torch.autograd.grad(value, [w["a"], w["b"]])
    for g, k in zip(grads, ("a", "b")):
        torch.testing.assert_close(g, c[k] - ci[k])


def test_model_contrastive_matches_hand_computation():
    z = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    z_glob = torch.tensor([[1.0, 0.0], [0.0, 3.0]])  # cos 1 and 1/sqrt(2)
    z_prev = torch.tensor([[0.0, 1.0], [1.0, 1.0]])  # cos 0 and 1
    apply = lambda params, x, slot=None: (params["z"], params["z"])
    ctx = LocalContext(apply, {"model": {"z": z}}, {"prev": {"z": z_prev}}, {"global": {"z": z_glob}},
                       torch.zeros(2, 1), torch.zeros(2, dtype=torch.long), torch.ones(2))
    tau, mu = 0.5, 3.0
    loss = ModelContrastive(mu, tau)(ctx)
    ce = [-math.log(math.exp(pos / tau) / (math.exp(pos / tau) + math.exp(neg / tau)))
          for pos, neg in ((1.0, 0.0), (1 / math.sqrt(2), 1.0))]
    assert loss.item() == pytest.approx(mu * sum(ce) / 2, rel=1e-6)


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.5, False), (0.9, True)])
def test_local_step_normaliser_is_the_total_weight_of_the_gradients(momentum, nesterov):
    """With a constant gradient 1 and lr 1, torch.optim.SGD moves a parameter by exactly the normaliser."""
    for tau in (1, 2, 7):
        p = torch.zeros(1, requires_grad=True)
        opt = torch.optim.SGD([p], lr=1.0, momentum=momentum, nesterov=nesterov)
        for _ in range(tau):
            p.grad = torch.ones(1)
            opt.step()
        cfg = OptimizerConfig(lr=1.0, momentum=momentum, nesterov=nesterov)
        a = local_step_normaliser(torch.tensor(float(tau)), cfg)  # float32, as the engine's step counts
        assert float(a) == pytest.approx(-p.item(), rel=1e-5)


# ---- reductions to FedAvg ---------------------------------------------------------------------------


@pytest.mark.parametrize("algo", [{"name": "fedcurv", "lam": 0.0}, {"name": "moon", "mu": 0.0},
                                  {"name": "fedntd", "beta": 0.0}])
def test_zero_weight_equals_fedavg(fd, algo):
    a = train(make_cfg({"name": "fedavg"}), fd)
    b = train(make_cfg(algo), fd)
    assert_trees_close(a.server["model"], b.server["model"], exact=True)


@pytest.mark.parametrize("algo", [{"name": "fedcurv", "lam": 1.0}, {"name": "moon", "mu": 1.0},
                                  {"name": "fedntd", "beta": 1.0}, {"name": "scaffold"}, {"name": "fedavgm"}])
def test_positive_weight_differs_from_fedavg(fd, algo):
    a = train(make_cfg({"name": "fedavg"}), fd)
    b = train(make_cfg(algo), fd)
    assert not torch.allclose(leaves(a.server["model"])[0], leaves(b.server["model"])[0], atol=1e-6)


def test_fednova_equal_steps_plain_sgd_equals_fedavg(fd_iid):
    kw = {"clients": 6, "partition": {"scheme": "iid"}, "client_test": 0.0, "rounds": 3, "per_round": 4,
          "optimizer": {"lr": 0.05, "momentum": 0.0, "weight_decay": 1e-3}}
    a = train(make_cfg({"name": "fedavg"}, **kw), fd_iid)
    assert len(set(a.split["train"].sizes.tolist())) == 1  # every client takes the same number of steps
    b = train(make_cfg({"name": "fednova"}, **kw), fd_iid)
    assert_trees_close(a.server["model"], b.server["model"], atol=1e-5, rtol=1.3e-6)  # torch.testing defaults


def test_fednova_ccvr_shifts_gradients_by_the_previous_normalised_update(fd):
    """ccvr keeps d_i / lr per client (d_i: the normalised update it uploaded) and subtracts it from every later
    local gradient: with the task loss alone the step is -lr (g - d_i / lr)."""
    from fedmosaic.algorithms.terms import GradientShift
    from fedmosaic.protocol.context import LocalContext

    fed = build_federation(make_cfg({"name": "fednova", "ccvr": True}, rounds=1), fd)
    calls = spy_aggregate(fed)
    cohort = spy_cohorts(fed)
    fed.round(0)
    _, up, _ = calls[0]
    g = fed.groups[0]
    rows = torch.as_tensor(fed.row_of[cohort[0]])
    lr = fed.cfg.train.optimizer.lr_at(0)
    for name, d in up["d"].items():
        torch.testing.assert_close(g.store["shift"][name][rows], d / lr)
    untouched = np.setdiff1d(np.arange(fed.num_clients), cohort[0])
    assert all(float(t[torch.as_tensor(fed.row_of[untouched])].abs().max()) == 0 for t in g.store["shift"].values())
    # the term's gradient is exactly -shift and its value 0
    w = {"w": torch.randn(3, requires_grad=True)}
    shift = {"w": torch.tensor([1.0, -2.0, 0.5])}
    ctx = LocalContext(None, {"model": w}, {"shift": shift}, {}, None, None, None)
    value = GradientShift("shift")(ctx)
    (grad,) = torch.autograd.grad(value, [w["w"]])
    assert float(value) == 0 and torch.equal(grad, -shift["w"])


def test_fednova_ccvr_off_is_unchanged_and_on_differs(fd):
    a = train(make_cfg({"name": "fednova"}), fd)
    b = train(make_cfg({"name": "fednova", "ccvr": False}), fd)
    c = train(make_cfg({"name": "fednova", "ccvr": True}), fd)
    assert_trees_close(a.server["model"], b.server["model"], exact=True)
    assert not torch.allclose(leaves(a.server["model"])[0], leaves(c.server["model"])[0], atol=1e-6)


@pytest.mark.cpu
def test_fednova_aggregation_matches_formula(fd):
    """Ragged step counts and momentum: w^{t+1} = w^t - (sum p_i a_i) sum p_i (w^t - w_i) / a_i, by hand."""
    fed = build_federation(make_cfg({"name": "fednova"}, rounds=1), fd)
    calls = spy_aggregate(fed)
    cohorts = spy_cohorts(fed)
    # the uploads are normalised already; recover w_i from a FedAvg run over the same cohort and batches
    avg = build_federation(make_cfg({"name": "fedavg"}, rounds=1), fd)
    avg_calls = spy_aggregate(avg)
    fed.round(0)
    avg.round(0)
    (server, up, _), (_, up_avg, _) = calls[0], avg_calls[0]
    sizes = fed.split["train"].sizes[cohorts[0]]
    taus = 2 * np.ceil(sizes / 8)
    assert len(set(taus.tolist())) > 1  # really ragged
    rho = 0.9
    a = [sum((1 - rho**m) / (1 - rho) for m in range(1, int(tau) + 1)) for tau in taus]
    torch.testing.assert_close(up["a"], torch.tensor(a, dtype=torch.float32))
    p = torch.tensor(sizes / sizes.sum(), dtype=torch.float32)
    tau_eff = float((p * torch.tensor(a)).sum())
    for name, w0 in server["model"].items():
        wi = up_avg["model"][name]  # the same local training (FedNova changes only the server)
        d = sum(p[i] * (w0 - wi[i]) / a[i] for i in range(len(a)))
        torch.testing.assert_close(fed.server["model"][name], w0 - tau_eff * d, atol=1e-6, rtol=1e-5)


def test_fedavgm_server_momentum_recursion(fd):
    fed = build_federation(make_cfg({"name": "fedavgm", "beta": 0.9}, rounds=3), fd)
    calls = spy_aggregate(fed)
    for t in range(3):
        fed.round(t)
    v = None
    for server, up, weights in calls:
        p = weights / weights.sum()
        avg = {k: torch.einsum("n,n...->...", p, t) for k, t in up["model"].items()}
        v = {k: (0 if v is None else 0.9 * v[k]) + (server["model"][k] - avg[k]) for k in avg}
        expected = {k: server["model"][k] - v[k] for k in avg}
    assert_trees_close(fed.server["model"], expected, atol=1e-6, rtol=1e-5)
    assert_trees_close(fed.server["v"], v, atol=1e-6, rtol=1e-5)


# ---- SCAFFOLD ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_scaffold_control_variates_match_hand_computation(fd3, momentum):
    """3 clients, 2 per round, logistic regression: c_i+ = c_i - c + (w^t - w_i) / (K_i lr), c += (|S|/N) mean dc."""
    lr, batch, epochs = 0.1, 50, 1
    cfg = make_cfg({"name": "scaffold"}, clients=3, client_test=0.0, model={"name": "logreg"}, rounds=3, per_round=2,
                   epochs=epochs, batch=batch, optimizer={"lr": lr, "momentum": momentum})
    fed = build_federation(cfg, fd3)
    calls, cohorts = spy_aggregate(fed), spy_cohorts(fed)
    sizes = fed.split["train"].sizes
    zeros = {k: torch.zeros_like(t) for k, t in fed.server["model"].items()}
    c_client = {k: dict(zeros) for k in range(3)}
    for t in range(3):
        fed.round(t)
        server, up, _ = calls[t]
        cohort = cohorts[t]
        assert len(cohort) == 2
        c = server["c"]
        dcs = []
        for row, k in enumerate(cohort.tolist()):
            steps = epochs * math.ceil(sizes[k] / batch)
            K = sum(momentum ** j for m in range(steps) for j in range(m + 1))  # = steps without momentum
            new = {n: c_client[k][n] - c[n] + (server["model"][n] - up["model"][n][row]) / (K * lr) for n in c}
            dcs.append({n: new[n] - c_client[k][n] for n in c})
            c_client[k] = new
        expected_c = {n: c[n] + (2 / 3) * (dcs[0][n] + dcs[1][n]) / 2 for n in c}
        assert_trees_close(fed.server["c"], expected_c, atol=1e-5, rtol=1e-4)
        for k in range(3):
            assert_trees_close({n: fed.groups[0].store["c"][n][k] for n in c}, c_client[k], atol=1e-5, rtol=1e-4)
    assert float(sum((t * t).sum() for t in fed.server["c"].values())) > 0
    assert len({tuple(x) for x in cohorts}) > 1  # a client sat out a round at least once


# ---- FedCurv ------------------------------------------------------------------------------------------------


def test_fedcurv_server_sums_track_latest_client_statistics(fd):
    fed = build_federation(make_cfg({"name": "fedcurv", "lam": 1.0}, rounds=3), fd)
    cohorts = spy_cohorts(fed)
    tr = fed.groups[0].trainer
    seen = []
    orig = tr._finish

    def spy(params, states, *payload_and_stats):
        stats = payload_and_stats[-1]
        seen.append((tmap(torch.clone, stats["grad_sq"]["model"]), tmap(torch.clone, params["model"])))
        return orig(params, states, *payload_and_stats)

    tr._finish = spy
    latest_u, latest_v = {}, {}
    for t in range(3):
        fed.round(t)
        (gsq, w), cohort = seen[t], cohorts[t]
        for row, k in enumerate(cohort.tolist()):
            latest_u[k] = {n: g[row] for n, g in gsq.items()}
            latest_v[k] = {n: g[row] * w[n][row] for n, g in gsq.items()}
        U = {n: sum(latest_u[k][n] for k in latest_u) for n in gsq}
        V = {n: sum(latest_v[k][n] for k in latest_v) for n in gsq}
        assert_trees_close(fed.server["U"], U, atol=1e-7, rtol=1e-5)
        assert_trees_close(fed.server["V"], V, atol=1e-7, rtol=1e-5)
        store = fed.groups[0].store
        for k in range(fed.num_clients):
            own = {n: store["u"][n][k] for n in gsq}
            if k in latest_u:
                assert_trees_close(own, latest_u[k], exact=True)
            else:
                assert all(float(x.abs().sum()) == 0 for x in own.values())
            # what client k trains with: P = U - u_k = the other clients' latest u only
            P = {n: fed.server["U"][n] - own[n] for n in gsq}
            others = {n: sum((latest_u[j][n] for j in latest_u if j != k), torch.zeros_like(U[n])) for n in gsq}
            assert_trees_close(P, others, atol=1e-6, rtol=1e-4)
    assert all(float(t.sum()) > 0 for t in fed.server["U"].values())
    assert len(latest_u) > len(cohorts[0])  # the sums span clients of several rounds


# ---- backends ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", [{"name": "fedntd", "beta": 1.0, "tau": 2.0}, {"name": "fedcurv", "lam": 10.0},
                                  {"name": "scaffold"}, {"name": "fednova"}, {"name": "fednova", "ccvr": True},
                                  {"name": "moon", "mu": 1.0},
                                  {"name": "fedavgm", "beta": 0.9}])
def test_vectorized_equals_sequential(fd, algo):
    ref = train(make_cfg(algo, backend="sequential"), fd)
    vec = train(make_cfg(algo, backend="vectorized", chunk_size=2), fd)
    assert_trees_close(ref.server, vec.server, atol=1e-5, rtol=1e-4)
    if leaves(ref.groups[0].store):
        assert_trees_close(ref.groups[0].store, vec.groups[0].store, atol=1e-5, rtol=1e-4)
