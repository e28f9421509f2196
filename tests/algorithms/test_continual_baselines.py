"""The continual baselines of ProtoFCL's Table 2 that fedmosaic builds last: FedRecon (the authors' rule: running
class means of a frozen encoder merged by sample counts), and the two reconstructions, FedSI (synaptic
intelligence on the shared model) and FedPMR (FedWeIT's decomposition with replay of recalled probabilities)."""

from __future__ import annotations

import pytest
import torch
from fedtest import assert_trees_close, train
from test_continual_family import make_cfg

from fedmosaic.algorithms.fedpmr import FedPMR
from fedmosaic.algorithms.fedrecon import FedRecon
from fedmosaic.algorithms.fedsi import FedSI
from fedmosaic.errors import ConfigError
from fedmosaic.protocol.context import LocalContext
from fedmosaic.protocol.program import Setting, Signals
from fedmosaic.protocol.tree import leaves
from fedmosaic.setup.world import build_federation


# ---- FedRecon --------------------------------------------------------------------------------------------------
@pytest.mark.cpu
@pytest.mark.parametrize("clients", [1, 4])
def test_fedrecon_merged_prototypes_are_the_centralised_class_means_of_every_embedding_seen(clients):
    """Four clients (and one: a local continual prototypical network), all in every round, five tasks: after every
    task, each class met has the mean of the frozen encoder's embeddings of all the clients' examples of it."""
    cfg = make_cfg(algorithm={"name": "fedrecon", "encoder": "initial"}, data__clients=clients,
                   train__clients_per_round=clients)
    fed = build_federation(cfg)
    g = fed.groups[0]
    data = fed.split["train"]
    with torch.no_grad():
        z, _ = g.apply(g.init, fed.transform(data.x))
    for t in range(cfg.train.rounds):
        fed.round(t)
        met = torch.as_tensor(fed.seen_classes(t // 2)) > 0
        counts = fed.server["counts"]
        assert ((counts > 0) == met).all()
        for c in torch.nonzero(met)[:, 0].tolist():
            mine = data.y == c
            assert counts[c] == mine.sum()  # every example once, whatever the rounds of its task
            torch.testing.assert_close(fed.server["sums"][c] / counts[c], z[mine].mean(0), atol=1e-5, rtol=1e-5)


def _recon(**cfg):
    return FedRecon(FedRecon.Config(**cfg), Setting(num_classes=3, feature_dim=2, rounds_per_task=2))


def test_fedrecon_merging_is_count_weighted_order_invariant_and_idempotent_without_new_data():
    algo = _recon()
    server = algo.init_server([{"w": torch.zeros(1)}])
    server["sums"][0], server["counts"][0] = torch.tensor([2.0, 2.0]), 2.0  # class 0: two examples seen before
    d_sum = torch.tensor([[[1.0, 0], [0, 0], [0, 0]], [[0.0, 0], [3, 3], [0, 0]], [[4.0, 1], [1, 1], [0, 0]]])
    d_count = torch.tensor([[1.0, 0, 0], [0, 3, 0], [3, 1, 0]])
    ups = {"model": {"w": torch.zeros(3, 1)}, "d_sum": d_sum, "d_count": d_count}
    sig = Signals(torch.arange(3), torch.zeros(3), torch.ones(3), 0.1)
    out = algo.aggregate(server, ups, torch.ones(3), 1, sig)
    pay = algo.broadcast(out, 2)
    torch.testing.assert_close(pay["protos"][0], torch.tensor([7.0, 3.0]) / 6)  # (2 + 1 + 4, 2 + 0 + 1) / 6
    torch.testing.assert_close(pay["protos"][1], torch.tensor([4.0, 4.0]) / 4)
    assert pay["has"].tolist() == [1, 1, 0]
    perm = torch.tensor([2, 0, 1])
    again = algo.aggregate(server, {k: v[perm] if torch.is_tensor(v) else {"w": v["w"][perm]} for k, v in ups.items()},
                           torch.ones(3), 1, sig)
    assert_trees_close(out, again, atol=1e-6)
    # a client that sends its class sums again, with nothing new, sends nothing: the merge does not move
    state = algo.init_client({"w": torch.zeros(1)})
    stats = {"sums": {"sum": torch.tensor([[1.0, 2], [0, 0], [0, 0]]), "count": torch.tensor([1.0, 0, 0])}}
    up1, state = algo.finish({"model": {"w": torch.zeros(1)}}, state, {}, stats)
    up2, state = algo.finish({"model": {"w": torch.zeros(1)}}, state, {}, stats)
    assert up1["d_count"].tolist() == [1, 0, 0] and not up2["d_sum"].any() and not up2["d_count"].any()
    stack = lambda u: {k: (v[None] if torch.is_tensor(v) else {"w": v["w"][None]}) for k, v in u.items()}  # noqa
    after = algo.aggregate(out, stack(up2), torch.ones(1), 3, Signals(torch.arange(1), torch.zeros(1),
                                                                        torch.ones(1), 0.1))
    assert_trees_close(after, out, exact=True)


def test_fedrecon_predicts_the_nearest_merged_prototype_and_its_head_before_any():
    algo = _recon()
    pay = {"protos": torch.tensor([[0.0, 0], [3, 0], [9, 9]]), "has": torch.tensor([1.0, 1, 0])}
    z = torch.tensor([[1.0, 0], [2.0, 0], [8.0, 8.0]])
    logits = torch.tensor([[0.0, 0, 5], [0, 0, 5], [5, 0, 0]])
    assert algo.eval_logits(z, logits, pay).argmax(1).tolist() == [0, 1, 1]  # class 2: no prototype, never
    torch.testing.assert_close(algo.eval_logits(z, logits, pay)[:, :2], -torch.cdist(z, pay["protos"][:2]) ** 2)
    none = {"protos": torch.zeros(3, 2), "has": torch.zeros(3)}
    assert torch.equal(algo.eval_logits(z, logits, none), logits)


def test_fedrecon_first_task_encoder_trains_then_freezes():
    cfg = make_cfg(algorithm={"name": "fedrecon"}, train__clients_per_round=4)
    fed = train(cfg, None, rounds=1)  # round 0 of task 0 (two rounds): the encoder trains, nothing reported
    trained = {k: v.clone() for k, v in fed.server["model"].items()}
    assert not fed.server["counts"].any() and any((trained[k] != fed.groups[0].init[k]).any() for k in trained)
    for t in range(1, 6):
        fed.round(t)
        assert_trees_close(fed.server["model"], trained, exact=True)  # frozen from the first task's last round
    assert fed.server["counts"].sum() > 0
    with pytest.raises(ConfigError, match="rounds_per_task must be at least 2"):
        FedRecon(setting=Setting(rounds_per_task=1))


# ---- FedSI -----------------------------------------------------------------------------------------------------
def test_fedsi_path_integral_on_a_quadratic_is_its_known_importance():
    """L = 1/2 Σ h_k (θ_k − θ*_k)^2: the path integral of −g dθ from θ_0 to θ* is h (θ_0 − θ*)^2 / 2 in each
    coordinate, whatever the path (here three rounds, each a straight segment from the model received; the second
    starts where the first did not end, as a client whose global model moved between its rounds); Zenke et al.'s
    importance ω / (Δ^2 + ξ) is then ≈ h / 2."""
    h = torch.tensor([0.5, 2.0, 8.0])
    star, start = torch.tensor([1.0, -1.0, 0.5]), torch.tensor([3.0, 1.0, -1.5])
    algo = FedSI(FedSI.Config(xi=1e-6), Setting(num_classes=2))
    state = algo.init_client({"w": start})
    grad = lambda th: {"model": {"w": h * (th - star)}}  # noqa: E731
    path = [(start, torch.tensor([2.0, 0.0, 0.0])), (torch.tensor([2.5, -0.5, 1.0]), torch.tensor([1.5, -2.0, 1.0])),
            (torch.tensor([1.5, -2.0, 1.0]), star)]
    expect = torch.zeros(3)
    for a, b in path:
        _, state = algo.finish({"model": {"w": b}}, state, {"global": {"w": a}}, {"g_start": grad(a), "g_end": grad(b)})
        expect += 0.5 * h * ((a - star) ** 2 - (b - star) ** 2)  # the exact integral of each segment
    torch.testing.assert_close(state["omega"]["w"], expect)
    end = algo.end_task(state, {"w": star}, {}, torch.ones(2), {})
    # the segments' integrals telescope except where the path jumped (2.0 -> 2.5, ...): with no jump, h / 2
    torch.testing.assert_close(end["importance"]["w"], expect / ((star - start) ** 2 + 1e-6))
    algo2 = FedSI(FedSI.Config(xi=1e-6), Setting(num_classes=2))
    st = algo2.init_client({"w": start})
    _, st = algo2.finish({"model": {"w": star}}, st, {"global": {"w": start}}, {"g_start": grad(start),
                                                                                "g_end": grad(star)})
    end = algo2.end_task(st, {"w": star}, {}, torch.ones(2), {})
    torch.testing.assert_close(end["importance"]["w"], h / 2, rtol=1e-5, atol=1e-5)
    assert not end["omega"]["w"].any() and torch.equal(end["anchor"]["w"], star)
    # a segment along which the loss rose gives no importance (never a negative, concave penalty)
    _, st = algo2.finish({"model": {"w": start}}, end, {"global": {"w": star}}, {"g_start": grad(star),
                                                                                 "g_end": grad(start)})
    assert (st["omega"]["w"] < 0).all()
    assert torch.equal(algo2.end_task(st, {"w": start}, {}, torch.ones(2), {})["importance"]["w"], end["importance"]["w"])


def test_fedsi_penalty_and_reduction_to_fine_tuning():
    algo = FedSI(FedSI.Config(c=0.5), Setting(num_classes=2))
    w, anchor, imp = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0]), torch.tensor([2.0, 4.0])
    ctx = LocalContext(lambda p, x, slot=None: (x, x @ p["w"][:, None].expand(2, 2) * torch.tensor([1.0, -1.0])),
                       {"model": {"w": w}}, {"anchor": {"w": anchor}, "importance": {"w": imp}}, {},
                       torch.tensor([[1.0, 0.0]]), torch.tensor([0]), torch.ones(1))
    logits = torch.tensor([[1.0, -1.0]])
    want = torch.nn.functional.cross_entropy(logits, torch.tensor([0])) + 0.5 * (2 * 1 + 4 * 1)
    torch.testing.assert_close(algo.loss(ctx), want)
    si = train(make_cfg(algorithm={"name": "fedsi", "c": 0.0}, data__tasks__memory=None), None, rounds=5)
    ft = train(make_cfg(algorithm={"name": "fedavg"}, data__tasks__memory=None), None, rounds=5)
    assert_trees_close(si.server["model"], ft.server["model"], exact=True)
    assert sum(float(t.abs().sum()) for t in leaves(si.groups[0].store["importance"])) > 0  # measured all along


# ---- FedPMR ----------------------------------------------------------------------------------------------------
def test_fedpmr_without_recall_and_replay_is_fedweit():
    pmr = train(make_cfg(algorithm={"name": "fedpmr", "recall": 0.0}, data__tasks__memory=None), None, rounds=5)
    weit = train(make_cfg(algorithm={"name": "fedweit"}, data__tasks__memory=None), None, rounds=5)
    assert_trees_close(pmr.server, weit.server, exact=True)
    mine = {k: v for k, v in pmr.groups[0].store.items() if k not in ("teacher", "known")}
    assert_trees_close(mine, weit.groups[0].store, exact=True)


def test_fedpmr_recalls_the_previous_models_probabilities_on_memory_samples_only():
    algo = FedPMR(FedPMR.Config(recall=2.0, T=1.0), Setting(num_classes=3))
    old = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 9.0]])  # the teacher's logits
    student = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 3.0], [0.0, 0.0, 0.0]])
    ctx = LocalContext(lambda p, x, slot=None: (x, old), {}, {"teacher": {}, "known": torch.tensor([1.0, 1.0, 0.0])},
                       {"own": {"task_classes": torch.tensor([0.0, 0.0, 1.0])}}, torch.zeros(3, 1),
                       torch.tensor([0, 1, 2]), torch.tensor([1.0, 1.0, 1.0]))
    got = algo.recall(ctx, student)
    # samples 0 and 1 are replayed (classes 0, 1 are not the task's); over the known classes 0 and 1
    ce = -(torch.softmax(old[:2, :2], 1) * torch.log_softmax(student[:2, :2], 1)).sum(1)
    torch.testing.assert_close(got, 2.0 * ce.mean())
    assert FedPMR(FedPMR.Config(recall=0.0), Setting(num_classes=3)).recall(ctx, student) is None
