"""The personalization baselines every peer library ships (issue 40): FedPer, FedRep, LG-FedAvg, FedBABU, FedDyn,
APFL (Deng et al.), FedRoD — each on identical tensors against its authors' rule, with its reduction where one
exists."""

from __future__ import annotations

import copy

import pytest
import torch
from fedtest import BLOBS6, assert_trees_close, blobs6_partition, train, with_overrides

from fedmosaic.engine.federation import Federation
from fedmosaic.protocol.tree import tmap
from fedmosaic.setup.world import build_federation


def make_cfg(**over):
    return with_overrides(copy.deepcopy(BLOBS6), **over)


@pytest.fixture(scope="module")
def fd(blob_data):
    return blobs6_partition(blob_data)


def parts(fed: Federation, tree: dict) -> tuple[dict, dict]:
    head = set(fed.algo.setting.head_keys)
    return {k: v for k, v in tree.items() if k not in head}, {k: v for k, v in tree.items() if k in head}


def client_state(fed: Federation, k: int) -> dict:
    g = fed.groups[0]
    return tmap(lambda t: t[int(fed.row_of[k])], g.store)


# ---- FedPer, FedRep, LG-FedAvg ---------------------------------------------------------------------------
@pytest.mark.parametrize("name, shared", [("fedper", "body"), ("lg_fedavg", "head")])
def test_a_split_model_federates_one_part_and_its_first_round_is_fedavgs(fd, name, shared):
    """Every client starts from the same model, so round 0 trains as FedAvg does: the server's part is FedAvg's
    average of it; each client keeps its other part as it trained it, and its model is the two together."""
    avg = train(make_cfg(algorithm={"name": "fedavg"}, train={"clients_per_round": 6}), fd, rounds=1)
    fed = train(make_cfg(algorithm={"name": name}, train={"clients_per_round": 6}), fd, rounds=1)
    body, head = parts(fed, avg.server["model"])
    assert_trees_close(fed.server["shared"], body if shared == "body" else head, atol=1e-6, rtol=1e-5)
    own = [client_state(fed, k)["own"] for k in range(6)]
    assert set(own[0]) == set(head if shared == "body" else body)
    assert not torch.equal(*(next(iter(o.values())) for o in own[:2]))  # each client its own part
    payload = fed.algo.broadcast(fed.server, 1)
    assert_trees_close(fed.algo.personal_params({"own": own[3]}, payload), {**fed.server["shared"], **own[3]},
                       exact=True)
    assert "global" not in fed.evaluate(0) and fed.evaluate(0)["personal"]["acc"] > 0


def test_fedrep_trains_the_head_first_then_the_body_and_without_head_epochs_keeps_the_initial_head(fd):
    fed = build_federation(make_cfg(algorithm={"name": "fedrep", "head_epochs": 2}), fd)
    init_body, init_head = parts(fed, fed.groups[0].init)
    phases = fed.algo.program(0)
    assert [p.updates[0].slots for p in phases] == [("head",), ("body",)] and phases[0].epochs == 2
    assert phases[1].epochs is None  # the body: train.local_epochs
    fed.round(0)
    trained = [k for k in range(6) if not torch.equal(client_state(fed, k)["own"]["fc.weight"],
                                                      init_head["fc.weight"])]
    assert trained  # the cohort's heads moved
    frozen = train(make_cfg(algorithm={"name": "fedrep", "head_epochs": 0}), fd, rounds=2)
    for k in range(6):
        assert_trees_close(client_state(frozen, k)["own"], init_head, exact=True)
    assert not torch.equal(frozen.server["shared"]["body.0.weight"], init_body["body.0.weight"])


# ---- FedBABU ------------------------------------------------------------------------------------------------
def test_fedbabu_never_updates_the_head_averages_the_body_and_fine_tunes_the_whole_model(fd):
    fed = train(make_cfg(algorithm={"name": "fedbabu"}), fd, rounds=2)
    init_body, init_head = parts(fed, fed.groups[0].init)
    body, head = parts(fed, fed.server["model"])
    assert_trees_close(head, init_head, exact=True)  # the authors' head learning rate 0
    assert not torch.equal(body["body.0.weight"], init_body["body.0.weight"])
    # the body trains as FedRep's does without its head phase: both train the body under the initial head
    rep = train(make_cfg(algorithm={"name": "fedrep", "head_epochs": 0}), fd, rounds=2)
    assert_trees_close(rep.server["shared"], body, atol=1e-6, rtol=1e-5)
    (ft,) = fed.algo.finetune()
    assert ft.epochs == 5 and ft.updates[0].lr == 1e-3 and ft.updates[0].slots is None  # body and head
    g = fed.groups[0]
    mine = fed.runtime.personal(g, 1, fed.algo.broadcast(fed.server, 1), fed.assign(g.clients))
    assert set(mine) == set(fed.server["model"])
    assert not torch.equal(mine["fc.weight"][0], init_head["fc.weight"])  # fine-tuned: the head moved too


# ---- FedDyn ------------------------------------------------------------------------------------------------
def test_feddyn_without_its_regulariser_is_fedavg_exactly(fd):
    a = train(make_cfg(algorithm={"name": "fedavg"}), fd)
    b = train(make_cfg(algorithm={"name": "feddyn", "alpha": 0.0}), fd)
    assert_trees_close(a.server["model"], b.server["model"], exact=True)


@pytest.mark.cpu  # the formula by hand, on host tensors
def test_feddyn_client_and_server_follow_the_papers_algorithm(fd):
    from fedmosaic.protocol.context import LocalContext
    from fedmosaic.protocol.program import Signals

    fed = build_federation(make_cfg(algorithm={"name": "feddyn", "alpha": 0.5}), fd)
    algo, a, N = fed.algo, 0.5, 6
    theta0 = fed.server["model"]
    gen = torch.Generator().manual_seed(0)
    noise = lambda t: torch.randn(t.shape, generator=gen)  # noqa: E731
    thetas = [tmap(lambda t: t + noise(t), theta0) for _ in range(2)]
    # the client: its objective's value and its state update
    g = tmap(noise, theta0)
    logits, y = torch.tensor([[1.0, -1.0, 0.5, 0.0, 0.2]]), torch.tensor([2])
    ctx = LocalContext(lambda p, x, slot=None: (None, logits), {"model": thetas[0]}, {"g": g}, {"global": theta0},
                       torch.zeros(1, 1), y, torch.ones(1))
    want = (torch.nn.functional.cross_entropy(logits, y) - sum((g[k] * thetas[0][k]).sum() for k in g)
            + a / 2 * sum(((thetas[0][k] - theta0[k]) ** 2).sum() for k in g))
    torch.testing.assert_close(algo.loss(ctx), want)
    up, state = algo.finish({"model": thetas[0]}, {"g": g}, {"global": theta0}, {})
    assert_trees_close(state["g"], {k: g[k] - a * (thetas[0][k] - theta0[k]) for k in g}, exact=True)
    # the server: h over every client (N), the model the weighted cohort mean minus h / alpha
    stacked = tmap(lambda *t: torch.stack(t), *thetas)
    w = torch.tensor([3.0, 1.0])
    new = algo.aggregate(fed.server, {"model": stacked}, w, 0, Signals(torch.tensor([0, 1]), w, w, 0.1))
    h = {k: -a / N * ((thetas[0][k] - theta0[k]) + (thetas[1][k] - theta0[k])) for k in theta0}
    assert_trees_close(new["h"], h, atol=1e-6)
    assert_trees_close(new["model"], {k: (3 * thetas[0][k] + thetas[1][k]) / 4 - h[k] / a for k in theta0},
                       atol=1e-5)


# ---- FedRoD ------------------------------------------------------------------------------------------------
def test_fedrod_balanced_generic_loss_and_detached_personal_head_on_a_hand_example(fd):
    from fedmosaic.protocol.context import LocalContext

    fed = build_federation(make_cfg(algorithm={"name": "fedrod"}), fd)
    algo = fed.algo
    d, C = 8, algo.num_classes
    z = torch.randn(3, d, requires_grad=True)
    zg = torch.randn(3, C, requires_grad=True)
    phead = {"fc.weight": torch.randn(C, d, requires_grad=True), "fc.bias": torch.randn(C, requires_grad=True)}
    y = torch.tensor([0, 2, 2])
    n = torch.tensor([1.0, 0.0, 4.0, 2.0, 3.0][:C])
    ctx = LocalContext(lambda p, x, slot=None: (z, zg), {"model": {}, "phead": phead}, {},
                       {"own": {"received": {"counts": {"n": n}}}}, torch.zeros(3, 1), y, torch.ones(3))
    loss = algo.loss(ctx)
    log_n = torch.log(n)  # log 0 = -inf: class 1 is never this client's label
    bsm = torch.nn.functional.cross_entropy(zg + log_n, y)
    zp = z @ phead["fc.weight"].T + phead["fc.bias"]
    personal = torch.nn.functional.cross_entropy(zg + zp, y)
    torch.testing.assert_close(loss, bsm + personal)
    loss.backward()
    zg_only = torch.autograd.grad(bsm, zg)[0]  # the personal term reaches neither the features nor z_g
    torch.testing.assert_close(zg.grad, zg_only)
    assert z.grad is None  # (the features reach the loss only detached)
    assert phead["fc.weight"].grad.abs().sum() > 0


def test_fedrod_personal_model_predicts_with_the_sum_of_both_heads(fd):
    fed = train(make_cfg(algorithm={"name": "fedrod"}), fd, rounds=2)
    g, algo = fed.groups[0], fed.algo
    state = client_state(fed, 1)
    payload = algo.broadcast(fed.server, 2)
    x = fed.split["test"].x[:5]
    z, zg = g.apply(fed.server["model"], x)
    zp = z @ state["phead"]["fc.weight"].T + state["phead"]["fc.bias"]
    _, personal = g.apply(algo.personal_params(state, payload), x)
    torch.testing.assert_close(personal, zg + zp, atol=1e-5, rtol=1e-5)
    assert not torch.equal(state["phead"]["fc.weight"], parts(fed, g.init)[1]["fc.weight"])


# ---- APFL (Deng et al.) ------------------------------------------------------------------------------------
def test_apfl_at_alpha_0_is_fedavg_and_at_alpha_1_its_personal_models_are_local(fd):
    avg = train(make_cfg(algorithm={"name": "fedavg"}), fd)
    zero = train(make_cfg(algorithm={"name": "apfl", "alpha": 0.0}), fd)
    assert_trees_close(zero.server["model"], avg.server["model"], exact=True)  # w steps first, on its own loss
    local = train(make_cfg(algorithm={"name": "local"}), fd)
    one = train(make_cfg(algorithm={"name": "apfl", "alpha": 1.0}), fd)
    assert_trees_close(one.groups[0].store["personal"], local.groups[0].store["model"], exact=True)
    assert zero.evaluate(2)["personal"]["acc"] == zero.evaluate(2)["global_clients"]["acc"]  # w(x) alone
    assert one.evaluate(2)["personal"]["acc"] == local.evaluate(2)["personal"]["acc"]  # v(x) alone


def test_apfl_steps_w_first_then_v_on_the_mix_at_the_updated_w(fd):
    """The authors' order on one batch (a client's whole train split, one step of each): w <- w - lr grad CE(w(x)),
    then v <- v - lr grad_v CE(alpha v(x) + (1 - alpha) w'(x)) at the UPDATED w'; v at the old w differs."""
    a, lr = 0.3, 0.05
    fed = train(make_cfg(algorithm={"name": "apfl", "alpha": a}, train__clients_per_round=6, train__batch_size=1000),
                fd, rounds=1)
    assert fed.settings.train.optimizer.lr == lr
    g, tr = fed.groups[0], fed.split["train"]
    F = torch.nn.functional

    def step(params, loss):
        grads = torch.autograd.grad(loss, list(params.values()))
        return {k: (t - lr * d).detach() for (k, t), d in zip(params.items(), grads, strict=True)}

    k = 2
    x, y = fed.transform(tr.x[tr.ptr[k]:tr.ptr[k + 1]]), tr.y[tr.ptr[k]:tr.ptr[k + 1]]
    init = {n: t.clone().requires_grad_(True) for n, t in g.init.items()}
    w1 = step(init, F.cross_entropy(g.apply(init, x)[1], y))
    mix = lambda w: F.cross_entropy(a * g.apply(init, x)[1] + (1 - a) * g.apply(w, x)[1], y)  # noqa: E731
    v1 = step(init, mix(w1))
    assert_trees_close(client_state(fed, k)["personal"], v1, atol=1e-6, rtol=1e-5)
    v_at_old_w = step(init, mix({n: t.detach() for n, t in g.init.items()}))
    assert not all(torch.allclose(v1[n], v_at_old_w[n], atol=1e-6) for n in v1)


def test_apfl_mixes_outputs_not_parameters_on_a_hand_example(fd):
    fed = train(make_cfg(algorithm={"name": "apfl", "alpha": 0.3}), fd, rounds=2)
    g, algo = fed.groups[0], fed.algo
    state = client_state(fed, 2)
    x = fed.split["test"].x[:4]
    _, lv = g.apply(state["personal"], x)
    _, lw = g.apply(fed.server["model"], x)
    _, mixed = algo.personal_forward(g.apply, algo.personal_params(state, algo.broadcast(fed.server, 2)), x)
    torch.testing.assert_close(mixed, 0.3 * lv + 0.7 * lw)
    _, of_mixed_weights = g.apply({k: 0.3 * state["personal"][k] + 0.7 * fed.server["model"][k]
                                   for k in state["personal"]}, x)
    assert not torch.allclose(mixed, of_mixed_weights)  # (the MLP is not linear)


# ---- FedBN -------------------------------------------------------------------------------------------------
def test_fedbn_on_a_model_without_batchnorm_is_fedavg_exactly(fd):
    avg = train(make_cfg(algorithm={"name": "fedavg"}), fd)
    bn = train(make_cfg(algorithm={"name": "fedbn"}), fd)
    assert bn.algo.setting.norm_keys == ()
    assert_trees_close(bn.server["shared"], avg.server["model"], exact=True)


def test_fedbn_keeps_each_clients_batchnorm_weights_and_statistics_and_averages_the_rest(fd):
    cfg = make_cfg(algorithm={"name": "fedbn"}, train={"clients_per_round": 6}, engine={"backend": "sequential"},
                   model={"name": "resnet10", "options": {"norm": "batch", "width": 0.125}})
    fed = build_federation(cfg, fd)
    g, keys = fed.groups[0], set(fed.algo.setting.norm_keys)
    modules = dict(g.module.named_modules())
    assert keys and all(isinstance(modules[k.rsplit(".", 1)[0]], torch.nn.BatchNorm2d) for k in keys)
    # a shortcut's BatchNorm: found by its type (the authors' name rule misses it)
    assert any("bn" not in k for k in keys)
    init = g.init
    fed.round(0)
    uploads_like = {k for k in fed.server["shared"]}
    assert uploads_like == set(init) - keys  # no BatchNorm parameter reaches the server
    a, b = client_state(fed, 0)["norm"], client_state(fed, 1)["norm"]
    assert set(a) == keys and not torch.equal(a["bn1.weight"], b["bn1.weight"])  # each its own
    stats = g.buffers["bn1.running_mean"]
    assert not torch.equal(stats[int(fed.row_of[0])], stats[int(fed.row_of[1])])  # and its own statistics
    mine = fed.algo.personal_params(client_state(fed, 1), fed.algo.broadcast(fed.server, 1))
    assert_trees_close(mine, {**fed.server["shared"], **b}, exact=True)


# ---- IFCA ----------------------------------------------------------------------------------------------------
def test_ifca_with_one_cluster_is_fedavg_exactly(fd):
    avg = train(make_cfg(algorithm={"name": "fedavg"}), fd)
    one = train(make_cfg(algorithm={"name": "ifca", "clusters": 1}), fd)
    assert_trees_close(tmap(lambda t: t[0], one.server["models"]), avg.server["model"], exact=True)


def test_ifca_clients_choose_the_model_of_lowest_train_loss_and_each_model_averages_its_choosers(fd):
    import torch.nn.functional as F

    fed = build_federation(make_cfg(algorithm={"name": "ifca", "clusters": 3}, train={"clients_per_round": 6}), fd)
    g, init, k = fed.groups[0], fed.groups[0].init, 3
    received = tmap(torch.clone, fed.server["models"])
    for name, t in init.items():  # three different draws of one initialisation
        assert torch.equal(received[name][0], t)
        assert torch.equal(received[name][2].flatten().sort().values, t.flatten().sort().values)
    assert not torch.equal(received["body.0.weight"][1], received["body.0.weight"][0])
    fed.round(0)
    tr, choice = fed.split["train"], {}
    for c in range(6):
        x, y = tr.x[tr.ptr[c] : tr.ptr[c + 1]], tr.y[tr.ptr[c] : tr.ptr[c + 1]]
        losses = [F.cross_entropy(g.apply(tmap(lambda t, j=j: t[j], received), x)[1], y).item() for j in range(k)]
        choice[c] = int(torch.tensor(losses).argmin())
        assert int(client_state(fed, c)["choice"].argmax()) == choice[c]
    for j in range(k):
        if j not in choice.values():  # a model nobody chose is kept
            assert_trees_close(tmap(lambda t, j=j: t[j], fed.server["models"]),
                               tmap(lambda t, j=j: t[j], received), exact=True)
    chosen = next(iter(set(choice.values())))
    assert not torch.equal(fed.server["models"]["body.0.weight"][chosen], received["body.0.weight"][chosen])
    mine = fed.algo.personal_params(client_state(fed, 0), fed.algo.broadcast(fed.server, 1))
    assert_trees_close(mine, tmap(lambda t: t[choice[0]], fed.server["models"]), exact=True)


def test_fedrod_refuses_a_head_that_is_not_one_linear_layer_in_one_line():
    from fedmosaic.algorithms.fedrod import FedRoD
    from fedmosaic.errors import ConfigError
    from fedmosaic.protocol.program import Setting

    with pytest.raises(ConfigError, match=r"^fedrod: the personal head .* has 1 parameters$"):
        FedRoD(setting=Setting(head_keys=("fc.weight",)))
    FedRoD(setting=Setting(head_keys=("fc.weight", "fc.bias")))
