"""Issue 19, items 2, 3 and 5: FedALA's start phase and ``p``, plain internal steps (FedALA's A, pFedMe's theta and
local model, Per-FedAvg's beta step, the MAML alpha steps), pFedMe's local rounds R and beta range, Per-FedAvg's
disjoint batches — each computed by hand from the authors' formulas and compared with the library."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fedtest import BLOBS6, assert_trees_close, blobs6_partition, train, with_overrides
from pydantic import ValidationError

from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.engine.seeding import FINETUNE
from fedmosaic.protocol.algorithm import Algorithm
from fedmosaic.protocol.program import Phase, Step
from fedmosaic.protocol.tree import leaves, tmap
from fedmosaic.setup.world import build_federation

#: momentum and weight decay in the run's optimiser: internal plain steps must ignore both
HEAVY = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}


def make_cfg(**over):
    return with_overrides(copy.deepcopy(BLOBS6), **{"train__optimizer": dict(HEAVY), **over})


@pytest.fixture(scope="module")
def fd(blob_data):
    return blobs6_partition(blob_data)


def ce(fed, params, x, y, m):
    """The masked mean cross-entropy of the run's model on one padded batch (as LocalContext.mean)."""
    logits = fed.groups[0].apply(params, fed.groups[0].trainer.transform(x))[1]
    return (F.cross_entropy(logits, y, reduction="none") * m).sum() / m.sum().clamp(min=1)


def batches(fed, plan, i, pair=False):
    """Client column ``i`` of a plan: its (x, y, mask[, x2, y2, mask2]) per step, in order."""
    tr = fed.split["train"]
    out = []
    for s in range(int(plan["steps"][i])):
        r, m = plan["rows"][s, i], plan["mask"][s, i]
        b = (tr.x[r], tr.y[r], m)
        if pair:
            r2 = plan["rows2"][s, i]
            b += (tr.x[r2], tr.y[r2], plan["mask2"][s, i])
        out.append(b)
    return out


def stacked(trees: list) -> dict:
    return tmap(lambda *ts: torch.stack(ts), *trees)


# ---- the engine's convergence loop (Phase.until) -------------------------------------------------------------
class Repeats(Algorithm):
    """Plain SGD on the task loss; client k runs its batches 1 + (k mod 3) times, at most 1 + max_repeats."""

    name = "repeats_test"
    max_repeats = 1

    @staticmethod
    def until(losses, params, state, payload):
        return torch.as_tensor(losses.shape[0]) >= 1 + payload["own"]["cid"] % 3

    def program(self, round_idx):
        return [Phase(updates=(Step(plain=True),), until=self.until, max_repeats=self.max_repeats)]


@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
@pytest.mark.parametrize("cap", [1, 5])
def test_phase_until_runs_the_same_batches_again_per_client(fd, monkeypatch, backend, cap):
    monkeypatch.setitem(ALGORITHMS, "repeats_test", Repeats)
    monkeypatch.setattr(Repeats, "max_repeats", cap)
    fed = build_federation(make_cfg(algorithm={"name": "repeats_test"}, engine={"backend": backend}), fd)
    g, tr = fed.groups[0], fed.split["train"]
    clients = np.arange(6)
    phase = fed.algo.program(0)[0]
    plan = g.trainer._plan(tr, clients, phase, 0, 5, 0, ())
    w0 = fed.server["model"]
    up, _, _, steps, _ = g.trainer.train(tr, clients, fed.algo.broadcast(fed.server, 0), {}, {}, lr=0.1, seed=5,
                                         round_idx=0, program=[phase])
    for k in clients:
        runs = min(1 + k % 3, 1 + cap)
        w = tmap(torch.clone, w0)
        for _ in range(runs):  # the same batches, in the same order, every run
            for x, y, m in batches(fed, plan, k):
                p = {n: v.clone().requires_grad_(True) for n, v in w.items()}
                gr = torch.autograd.grad(ce(fed, p, x, y, m), list(p.values()))
                w = {n: v - 0.1 * gk for (n, v), gk in zip(w.items(), gr)}
        assert steps[k] == runs * plan["steps"][k]
        assert_trees_close(tmap(lambda t, k=k: t[k], up["model"]), w, atol=1e-6, rtol=1e-5)


# ---- FedALA ----------------------------------------------------------------------------------------------------
def test_fedala_p0_mixes_every_tensor_as_the_authors_layer_idx_0():
    """The authors' params[-layer_idx:] with layer_idx = 0 is params[-0:] = every parameter tensor."""
    model = {"a.weight": torch.ones(2), "a.bias": torch.ones(1), "fc.weight": torch.ones(3), "fc.bias": torch.ones(1)}
    fedala = ALGORITHMS["fedala"]
    assert fedala(fedala.Config(p=0))._top(model) == list(model)
    assert fedala(fedala.Config(p=2))._top(model) == ["fc.weight", "fc.bias"]
    assert fedala(fedala.Config(p=9))._top(model) == list(model)
    assert set(fedala(fedala.Config(p=0)).init_client(model)["A"]) == set(model)


def test_fedala_weights_stay_one_where_their_gradient_is_zero_under_momentum_and_weight_decay(fd):
    """Round 0: every client has w_loc = w_glob, so dL/dA = dL/dmix * (w_glob - w_loc) = 0 exactly; a plain step
    keeps A = 1 (the run's SGD with weight decay 0.01 and momentum would shrink it)."""
    fed = train(make_cfg(algorithm={"name": "fedala"}), fd, rounds=1)
    assert leaves(fed.groups[0].store["A"]) and all(bool((t == 1).all()) for t in leaves(fed.groups[0].store["A"]))


@pytest.mark.cpu
def test_fedala_start_phase_trains_a_until_the_loss_std_settles(fd):
    """Three clients in one cohort, ALA alone, every tensor mixed (p = 0), the run's optimiser with momentum and
    weight decay. Client 0 (never trained: w_loc = w_glob) takes one pass and A stays 1; client 1 (trained once:
    the start phase) repeats its pass over the same batches until len(losses) > window and the population std of
    the last `window` pass losses (each the loss of the pass's last batch) is below threshold, as the authors'
    ALA.py; client 2 (past its start phase) takes one pass. Every step: A <- clip(A - eta * dL/dmix *
    (w_glob - w_loc), 0, 1), recomputed from the authors' formula here."""
    eta, thr, window = 2.0, 0.02, 3
    cfg = make_cfg(algorithm={"name": "fedala", "p": 0, "eta": eta, "sample": 0.5, "threshold": thr,
                              "window": window, "max_start_passes": 60})
    fed = build_federation(cfg, fd)
    algo, g, tr = fed.algo, fed.groups[0], fed.split["train"]
    glob = tmap(torch.clone, fed.server["model"])
    gen = torch.Generator().manual_seed(0)
    locals_ = [{k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in glob.items()} for _ in range(3)]
    ones = {k: torch.ones_like(v) for k, v in glob.items()}
    states = stacked([{"local": loc, "A": ones, "seen": torch.tensor(float(s))} for loc, s in zip(locals_, (0, 1, 2))])
    clients = np.array([0, 1, 2])
    phase = algo.program(0)[0]
    plan = g.trainer._plan(tr, clients, phase, 0, 5, 0, ())
    _, new, _, steps, _ = g.trainer.train(tr, clients, algo.broadcast(fed.server, 0), states, {}, lr=0.05, seed=5,
                                          round_idx=0, program=[phase])
    for i, seen in enumerate((0, 1, 2)):
        loc = glob if seen == 0 else locals_[i]
        A, losses = dict(ones), []
        while True:
            for x, y, m in batches(fed, plan, i):
                mix = {k: (loc[k] + (glob[k] - loc[k]) * A[k]).requires_grad_(True) for k in glob}
                loss = ce(fed, mix, x, y, m)
                gmix = dict(zip(mix, torch.autograd.grad(loss, list(mix.values()))))
                A = {k: (A[k] - eta * gmix[k] * (glob[k] - loc[k])).clamp(0, 1) for k in A}
            losses.append(float(loss.detach()))
            if seen != 1 or (len(losses) > window and np.std(losses[-window:]) < thr) or len(losses) == 60:
                break
        if seen == 1:
            assert window + 1 < len(losses) < 60  # the criterion, not the cap, ended it
        assert steps[i] == len(losses) * plan["steps"][i]
        assert_trees_close(tmap(lambda t, i=i: t[i], new["A"]), A, atol=1e-5, rtol=1e-4)
    assert all(bool((t[0] == 1).all()) for t in leaves(new["A"]))
    assert [int(s) for s in new["seen"]] == [1, 2, 2]


@pytest.mark.cpu
def test_fedala_start_phase_is_capped(fd):
    """A threshold no pass can reach: the start phase stops after max_start_passes passes."""
    cfg = make_cfg(algorithm={"name": "fedala", "threshold": 1e-30, "max_start_passes": 4, "sample": 0.5})
    fed = build_federation(cfg, fd)
    algo, g, tr = fed.algo, fed.groups[0], fed.split["train"]
    state = algo.init_client(fed.server["model"])
    state = {**state, "local": tmap(lambda t: t + 0.3, state["local"]), "seen": torch.tensor(1.0)}
    phase = algo.program(0)[0]
    plan = g.trainer._plan(tr, np.array([3]), phase, 0, 5, 0, ())
    steps = g.trainer.train(tr, np.array([3]), algo.broadcast(fed.server, 0), stacked([state]), {}, lr=0.05,
                            seed=5, round_idx=0, program=[phase])[3]
    assert steps[0] == 4 * plan["steps"][0]


# ---- pFedMe ------------------------------------------------------------------------------------------------------
def test_pfedme_local_rounds_are_plain_moreau_steps(fd):
    """R = 3 local rounds, each one minibatch with K = 2 steps theta <- theta - eta_p (grad f(theta) + lam (theta -
    w) + mu theta) then w <- w - eta lam (w - theta) (the authors' pFedMeOptimizer and userpFedMe.train, mu as
    theirs 0.001), all plain although the run's optimiser has momentum and weight decay."""
    lam, eta_p, eta, mu = 15.0, 0.01, 0.05, 0.001
    cfg = make_cfg(algorithm={"name": "pfedme", "R": 3, "K": 2, "lam": lam, "personal_lr": eta_p, "mu": mu})
    fed = build_federation(cfg, fd)
    algo, g, tr = fed.algo, fed.groups[0], fed.split["train"]
    clients = np.array([1, 4])
    phase = algo.program(0)[0]
    plan = g.trainer._plan(tr, clients, phase, 0, 5, 0, ())
    store = tmap(lambda t: t[torch.as_tensor(fed.row_of[clients])], g.store)
    up, new, _, steps, _ = g.trainer.train(tr, clients, algo.broadcast(fed.server, 0), store, {}, lr=eta, seed=5,
                                           round_idx=0, program=[phase])
    assert steps.tolist() == [3, 3]  # R minibatches, whatever the client's size
    for i in range(2):
        theta, w = tmap(torch.clone, fed.server["model"]), tmap(torch.clone, fed.server["model"])
        for x, y, m in batches(fed, plan, i):
            for _ in range(2):
                p = {k: v.clone().requires_grad_(True) for k, v in theta.items()}
                gr = dict(zip(p, torch.autograd.grad(ce(fed, p, x, y, m), list(p.values()))))
                theta = {k: theta[k] - eta_p * (gr[k] + lam * (theta[k] - w[k]) + mu * theta[k]) for k in theta}
            w = {k: w[k] - eta * lam * (w[k] - theta[k]) for k in w}
        assert_trees_close(tmap(lambda t, i=i: t[i], up["model"]), w, atol=1e-6, rtol=1e-4)
        assert_trees_close(tmap(lambda t, i=i: t[i], new["theta"]), theta, atol=1e-6, rtol=1e-4)


def test_pfedme_beta_up_to_the_papers_four_extrapolates():
    """w <- (1 - beta) w + beta * sum_k n_k / n * w_k, with beta = 4 (the paper's sensitivity study)."""
    algo = ALGORITHMS["pfedme"](ALGORITHMS["pfedme"].Config(beta=4.0))
    w = {"a": torch.tensor([1.0, 2.0])}
    ups = {"model": {"a": torch.tensor([[2.0, 2.0], [5.0, 0.0]])}}
    new = algo.aggregate({"model": w}, ups, torch.tensor([3.0, 1.0]), 0, None)
    mean = (3 * torch.tensor([2.0, 2.0]) + torch.tensor([5.0, 0.0])) / 4
    torch.testing.assert_close(new["model"]["a"], -3 * w["a"] + 4 * mean)
    with pytest.raises(ValidationError):
        ALGORITHMS["pfedme"].Config(beta=11.0)


# ---- Per-FedAvg, FedMeta ---------------------------------------------------------------------------------------
def test_perfedavg_batches_d_and_d_prime_are_disjoint_halves_of_one_shuffle(fd):
    """Each step's D and D' share no sample, and per epoch D and D' together hold every train sample once (2B
    samples of one permutation per step, as PFLlib's clientperavg): ceil(n / 2B) steps an epoch."""
    fed = build_federation(make_cfg(algorithm={"name": "perfedavg"}, train__local_epochs=2), fd)
    g, tr = fed.groups[0], fed.split["train"]
    clients = np.arange(6)
    plan = g.trainer._plan(tr, clients, fed.algo.program(0)[0], 0, 5, 0, ())
    for i, k in enumerate(clients):
        n, per = int(tr.sizes[k]), int(np.ceil(tr.sizes[k] / 16))
        assert plan["steps"][i] == 2 * per
        for e in range(2):
            seen = []
            for s in range(e * per, (e + 1) * per):
                d = plan["rows"][s, i][plan["mask"][s, i] > 0].tolist()
                d2 = plan["rows2"][s, i][plan["mask2"][s, i] > 0].tolist()
                assert not set(d) & set(d2)
                seen += d + d2
            assert sorted(seen) == list(range(tr.ptr[k], tr.ptr[k] + n))


def test_perfedavg_beta_step_is_plain(fd):
    """w <- w - beta grad f(w - alpha grad f(w; D); D') (first order), plain although the run's optimiser has
    momentum and weight decay (the authors' MySGD.step(beta=...))."""
    alpha, beta = 0.3, 0.2
    fed = build_federation(make_cfg(algorithm={"name": "perfedavg", "alpha": alpha, "beta": beta}), fd)
    algo, g, tr = fed.algo, fed.groups[0], fed.split["train"]
    clients = np.array([2])
    phase = algo.program(0)[0]
    plan = g.trainer._plan(tr, clients, phase, 0, 5, 0, ())
    up = g.trainer.train(tr, clients, algo.broadcast(fed.server, 0), {}, {}, lr=0.05, seed=5, round_idx=0,
                         program=[phase])[0]
    w = tmap(torch.clone, fed.server["model"])
    for x, y, m, x2, y2, m2 in batches(fed, plan, 0, pair=True):
        p = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        g1 = torch.autograd.grad(ce(fed, p, x, y, m), list(p.values()))
        q = {k: (w[k] - alpha * gk).requires_grad_(True) for k, gk in zip(w, g1)}
        g2 = torch.autograd.grad(ce(fed, q, x2, y2, m2), list(q.values()))
        w = {k: w[k] - beta * gk for k, gk in zip(w, g2)}
    assert_trees_close(tmap(lambda t: t[0], up["model"]), w, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name", ["perfedavg", "fedmeta"])
def test_maml_personalization_takes_plain_alpha_steps(fd, name):
    """The personal model: adapt_steps = 2 steps w <- w - alpha grad f(w) on train batches, plain (MAML's
    adaptation) although the run's optimiser has momentum and weight decay."""
    alpha = 0.3
    fed = build_federation(make_cfg(algorithm={"name": name, "alpha": alpha, "adapt_steps": 2}), fd)
    algo, g, tr = fed.algo, fed.groups[0], fed.split["train"]
    clients = np.array([0, 5])
    phases = algo.finetune()
    plan = g.trainer._plan(tr, clients, phases[0], 0, 5, 1, (FINETUNE,))
    own = {"cid": torch.as_tensor(clients)}
    got = g.trainer.adapt(tr, clients, algo.broadcast(fed.server, 1), own, {}, {}, program=phases, lr=0.05, seed=5,
                          round_idx=1)["model"]
    for i in range(2):
        w = tmap(torch.clone, fed.server["model"])
        for x, y, m in batches(fed, plan, i):
            p = {k: v.clone().requires_grad_(True) for k, v in w.items()}
            gr = torch.autograd.grad(ce(fed, p, x, y, m), list(p.values()))
            w = {k: w[k] - alpha * gk for k, gk in zip(w, gr)}
        assert_trees_close(tmap(lambda t, i=i: t[i], got), w, atol=1e-6, rtol=1e-4)
