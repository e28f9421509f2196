"""The continual family: task streams with exemplar memory, the previous task's model, continual evaluation,
ProtoFCL's prototype library, FedLwF / FedEWC reductions, vectorized == sequential and resume mid-task."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fedtest import assert_trees_close, train, with_overrides

from fedmosaic.algorithms.protofcl import ProtoFCL, distances
from fedmosaic.engine.client import memory as mem
from fedmosaic.engine.seeding import TASK_END
from fedmosaic.errors import ConfigError
from fedmosaic.protocol.context import LocalContext
from fedmosaic.protocol.program import Phase, Setting, Signals
from fedmosaic.protocol.tree import leaves
from fedmosaic.runs.records import TIMING_KEYS, read_metrics, summarize
from fedmosaic.runs.runner import run
from fedmosaic.setup.world import build_federation

R = 2  # rounds per task


def make_cfg(**over):
    """Four digits clients (sklearn's 8x8 digits), five tasks of two classes, two rounds each."""
    raw = {
        "seed": 5,
        "data": {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"},
                 "tasks": {"n_tasks": 5, "rounds_per_task": R, "memory": {"per_class": 3}}},
        "model": {"name": "mlp", "options": {"hidden": 16}},
        "algorithm": {"name": "protofcl"},
        "train": {"rounds": 10, "clients_per_round": 3, "batch_size": 16, "optimizer": {"lr": 0.05}},
        "eval": {"every": 100, "client_test": False},
        "checkpoint_every": 1,
    }
    return with_overrides(raw, **over)


def strip_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


# ---- exemplar memory ---------------------------------------------------------------------------------------
def test_batches_come_only_from_the_current_task_and_the_memory():
    fed = build_federation(make_cfg(train__clients_per_round=4))
    trainer, seen = fed.groups[0].trainer, []
    plan = trainer._plan

    def spy(data, clients, phase, *args):
        out = plan(data, clients, phase, *args)
        if phase.epochs is None:  # the training phase (not the task-end probe's pass)
            seen.append((clients, out["rows"], out["mask"]))
        return out

    trainer._plan = spy
    tr = fed.split["train"]
    for t in range(10):
        kept = [mem.offsets_of(m) for m in fed.exemplars]  # the memory this round trains with
        seen.clear()
        fed.round(t)
        assert seen
        for clients, rows, mask in seen:
            for i, k in enumerate(clients):
                _, classes, task = fed.tasks[k][t // R]
                drawn = rows[:, i][mask[:, i] > 0].cpu().numpy() - tr.ptr[k]
                assert sorted(drawn) == sorted(np.concatenate([task, kept[k]]))  # one epoch: each sample once
                old = set(tr.y[torch.as_tensor(kept[k] + tr.ptr[k])].tolist())
                assert set(tr.y[torch.as_tensor(drawn + tr.ptr[k])].tolist()) <= set(classes.tolist()) | old
                if t >= R:
                    assert len(kept[k]) and not old & set(classes.tolist())  # earlier classes only


def test_a_client_whose_task_stream_ends_drops_out_of_the_cohort(tmp_path):
    over = {"data__tasks__tasks_per_client": [2, 5], "data__tasks__order": "random", "train__clients_per_round": 4}
    lengths = [len(st) for st in build_federation(make_cfg(train__rounds=4, **over)).tasks]
    assert len(set(lengths)) > 1
    with pytest.raises(ConfigError, match=rf"longest client task stream \({max(lengths)} tasks of {R} rounds\)"):
        build_federation(make_cfg(train__rounds=R * max(lengths) + 1, **over))
    cfg = make_cfg(train__rounds=R * max(lengths), **over)
    run(cfg, tmp_path / "r", progress=False)
    records = read_metrics(tmp_path / "r")
    assert [r["clients"] for r in records] == [sum(n > t // R for n in lengths) for t in range(R * max(lengths))]
    s = summarize(records, cfg)
    assert len(s["continual_seen"]) == max(lengths) and np.isfinite(s["continual_avg"])


@pytest.mark.parametrize("budget", [{"per_class": 3}, {"total": 7}])
def test_the_memory_never_exceeds_its_budget_and_shrinks_by_keeping_prefixes(budget):
    fed = build_federation(make_cfg(data__tasks__memory=budget, train__clients_per_round=4))
    tr, before = fed.split["train"], [{} for _ in range(4)]
    for t in range(10):
        fed.round(t)
        if not fed.task_ends(t):
            continue
        for k, m in enumerate(fed.exemplars):
            sizes = [len(o) for o in m.values()]
            assert len(m) == 2 * (t // R + 1)  # every class met so far
            if "per_class" in budget:
                assert max(sizes) <= 3
            else:
                assert sum(sizes) <= 7 and max(sizes) == 7 // len(m)
            for c, o in m.items():
                assert (tr.y[torch.as_tensor(o + tr.ptr[k])] == c).all()  # each class holds its own samples
                if c in before[k]:
                    np.testing.assert_array_equal(o, before[k][c][: len(o)])
            before[k] = m


def test_rank_by_hand():
    gen = np.random.default_rng(0)
    f = torch.tensor([[0.0], [1.0], [2.0], [10.0], [-3.0]])  # mean 2: distances 2, 1, 0, 8, 5
    assert mem.rank(f, "nearest", 3, gen).tolist() == [2, 1, 0]
    assert mem.rank(f, "nearest", 9, gen).tolist() == [2, 1, 0, 4, 3]
    # herding on normalised features: two of +x, one of +y; the mean (2/3, 1/3) is best approached by +x, then +y
    h = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]])
    assert mem.rank(h, "herding", 3, gen).tolist() == [0, 1, 2]
    r = mem.rank(f, "random", 5, np.random.default_rng(1))
    assert sorted(r.tolist()) == list(range(5))
    offs = {7: np.array([40, 41, 42, 43, 44])}
    out = mem.refresh({3: np.array([9, 8, 7])}, {7: f}, offs, "nearest", None, 4, gen)
    assert out[7].tolist() == [42, 41] and out[3].tolist() == [9, 8]  # total 4 over two classes
    assert mem.unpack(mem.pack(out)).keys() == out.keys()
    assert all((mem.unpack(mem.pack(out))[c] == out[c]).all() for c in out)


def test_the_memory_holds_the_samples_nearest_to_each_class_prototype_under_the_clients_model():
    fed = build_federation(make_cfg(train__clients_per_round=4))
    for t in range(R):
        fed.round(t)
    g, tr = fed.groups[0], fed.split["train"]
    for k in range(4):
        _, classes, task = fed.tasks[k][0]
        params = {n: v[k] for n, v in g.store["model"].items()}
        rows = torch.as_tensor(tr.ptr[k] + task)
        with torch.no_grad():
            z = g.apply(params, fed.transform(tr.x[rows]))[0]
        for c in classes.tolist():
            zc, oc = z[tr.y[rows] == c], task[(tr.y[rows] == c).cpu().numpy()]
            nearest = oc[np.argsort((zc - zc.mean(0)).norm(dim=1).cpu().numpy(), kind="stable")[:3]]
            assert fed.exemplars[k][c].tolist() == nearest.tolist()


# ---- the previous task's model, FedLwF, FedEWC --------------------------------------------------------------
def test_every_client_keeps_the_model_it_predicted_with_at_the_end_of_each_task():
    fed = train(make_cfg(algorithm={"name": "fedlwf"}), None, rounds=R)
    seen = fed.seen_classes(0).astype(np.float32)
    for k in range(4):
        assert_trees_close({n: v[k] for n, v in fed.groups[0].store["teacher"].items()}, fed.server["model"],
                           exact=True)
        np.testing.assert_array_equal(fed.groups[0].store["known"][k].cpu().numpy(), seen)
    # ProtoFCL: each client its own model, and the library it predicted with then — the server's (global) or its
    # own (the paper's: its model's features, the nearest of its own prototypes as the head)
    fed = train(make_cfg(algorithm={"name": "protofcl", "prototypes": "global"}), None, rounds=R)
    assert_trees_close(fed.groups[0].store["teacher"], fed.groups[0].store["model"], exact=True)
    assert all(torch.equal(p, fed.server["protos"]) for p in fed.groups[0].store["teacher_protos"])
    fed = train(make_cfg(), None, rounds=R)
    store, head = fed.groups[0].store, fed.groups[0].trainer.algo.setting.head_keys
    body = lambda tree: {k: v for k, v in tree.items() if k not in head}  # noqa: E731
    assert_trees_close(body(store["teacher"]), body(store["model"]), exact=True)
    assert torch.equal(store["teacher_protos"], store["protos"])


@pytest.mark.parametrize("algo", [{"name": "fedlwf", "lam": 0.0}, {"name": "fedewc", "lam": 0.0}])
def test_fedlwf_and_fedewc_with_weight_0_are_fine_tuning(algo):
    ft = train(make_cfg(algorithm={"name": "fedavg"}), None, rounds=6)
    zero = train(make_cfg(algorithm=algo), None, rounds=6)
    assert_trees_close(zero.server["model"], ft.server["model"], exact=True)
    on = train(make_cfg(algorithm={**algo, "lam": 5.0}), None, rounds=6)  # (the test can fail)
    assert not torch.equal(leaves(on.server["model"])[0], leaves(ft.server["model"])[0])


@pytest.mark.cpu
def test_fedewc_anchors_at_the_global_model_with_the_fisher_of_the_task():
    fed = train(make_cfg(algorithm={"name": "fedewc"}), None, rounds=R)
    store = fed.groups[0].store
    assert_trees_close({n: v[1] for n, v in store["anchor"].items()}, fed.server["model"], exact=True)
    assert all((f >= 0).all() for f in leaves(store["fisher"])) and any(f.sum() > 0 for f in leaves(store["fisher"]))
    # the Fisher of client 0: the mean squared minibatch gradient over one pass of its task at the global model, of
    # the cross-entropy over the classes met so far (PyCIL's getFisherDiagonal: the whole grown head)
    g, tr = fed.groups[0], fed.split["train"]
    task_split = fed.train_split(R - 1, memory=False)
    plan = g.trainer._plan(task_split, np.array([0]), Phase(epochs=1), 0, fed.cfg.seed, R - 1, (TASK_END,))
    seen = torch.as_tensor(np.flatnonzero(fed.seen_classes(0)))
    total, n = None, 0
    for r, m in zip(plan["rows"][:, 0], plan["mask"][:, 0]):
        p = {k: v.clone().requires_grad_() for k, v in fed.server["model"].items()}
        real = m > 0
        _, logits = g.apply(p, fed.transform(tr.x[r[real]]))
        y = (tr.y[r[real]][:, None] == seen).int().argmax(1)  # the label's place among the seen classes
        grads = torch.autograd.grad(torch.nn.functional.cross_entropy(logits[:, seen], y), list(p.values()))
        sq = [gr * gr for gr in grads]
        total = sq if total is None else [a + b for a, b in zip(total, sq)]
        n += 1
    for mine, ref in zip(leaves({n_: v[0] for n_, v in store["fisher"].items()}), [t / n for t in total]):
        torch.testing.assert_close(mine, ref, atol=1e-6, rtol=1e-4)


# ---- ProtoFCL -----------------------------------------------------------------------------------------------
@pytest.mark.cpu
def test_protofcls_teacher_knows_the_classes_its_library_holds():
    fed = build_federation(make_cfg(train__clients_per_round=1, data__tasks__order="random",
                              algorithm={"name": "protofcl", "prototypes": "global"}))
    fed.round(0), fed.round(1)  # the end of task 0, one client in each round
    has, seen = fed.server["has"], torch.as_tensor(fed.seen_classes(0), dtype=torch.float32)
    assert has.sum() < seen.sum()  # some classes met by clients whose prototypes never reached the server
    assert (fed.groups[0].store["known"] == has).all()
    # the paper's reading: each client's teacher knows the classes of its own library
    fed = build_federation(make_cfg(train__clients_per_round=1, data__tasks__order="random"))
    fed.round(0), fed.round(1)
    store = fed.groups[0].store
    assert (store["known"] == store["has"] * seen).all() and (store["known"].sum(1) > 0).sum() == 2
    assert (store["teacher_protos"] == store["protos"]).all()


def test_the_prototype_library_is_the_unweighted_mean_over_the_clients_that_sent_each_class():
    algo = ProtoFCL(setting=Setting(num_classes=4, feature_dim=2, head_keys=HEAD))
    server = algo.init_server([{"w": torch.zeros(1)}])
    server["protos"][3] = torch.tensor([9.0, 9.0])
    server["has"][3] = 1.0  # a class from an earlier round that nobody sends now
    protos = torch.tensor([[[1.0, 0], [2, 2], [0, 0], [5, 5]],
                           [[3.0, 0], [0, 0], [0, 0], [0, 0]],
                           [[5.0, 6], [4, 4], [0, 0], [0, 0]]])
    has = torch.tensor([[1.0, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]])
    weights = torch.tensor([100.0, 1.0, 10.0])  # sample counts: ignored (unweighted)
    sig = Signals(torch.arange(3), torch.zeros(3), torch.ones(3), 0.1)
    out = algo.aggregate(server, {"protos": protos, "has": has}, weights, 0, sig)
    torch.testing.assert_close(out["protos"][0], torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(out["protos"][1], torch.tensor([3.0, 3.0]))
    torch.testing.assert_close(out["protos"][3], torch.tensor([9.0, 9.0]))  # kept
    assert out["has"].tolist() == [1, 1, 0, 1]


HEAD = ("head.weight", "head.bias")  # a linear head: what prediction by own prototypes needs


def _protofcl_batch():
    """A three-sample batch (one sample of each of classes 0, 1, 2) whose features are ``z``, a teacher whose
    features are ``old``, and a context builder."""
    z = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.0], [1.0, 1.0], [0.0, 1.0]])
    teacher, student = {"w": torch.tensor(0.0)}, {"w": torch.tensor(1.0)}

    def apply(params, x, slot=None):
        return (z, z) if params is student else (old, old)

    def ctx(state, payload):
        return LocalContext(apply, {"model": student}, {"teacher": teacher, **state}, payload, None,
                            torch.tensor([0, 1, 2]), torch.ones(3))
    return z, old, ctx


def _soft_ce(dt, ds, T):
    return -(torch.softmax(-dt / T, 1) * torch.log_softmax(-ds / T, 1)).sum(1).mean()


def test_protofcl_global_loss_by_hand():
    algo = ProtoFCL(ProtoFCL.Config(prototypes="global", beta=1.0), Setting(num_classes=3, feature_dim=2))
    z, old, ctx = _protofcl_batch()
    glob = torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 0.0]])
    payload = {"protos": glob, "has": torch.tensor([1.0, 1.0, 0.0])}
    tp = torch.tensor([[1.0, 1.0], [0.0, -1.0], [0.0, 0.0]])  # the library the teacher predicted with
    state = {"known": torch.tensor([1.0, 0.0, 0.0]), "teacher_protos": tp}
    y, T = torch.tensor([0, 1, 2]), algo.cfg.T
    protos = torch.stack([glob[0], glob[1], z[2].detach()])  # class 2 has no global prototype: its batch mean
    d = torch.cdist(z, protos)
    lc = torch.nn.functional.cross_entropy(-d / T, y)
    # L_D: only class 0 was known to the teacher: a softmax over one class is 1, its CE is 0
    lr = (z[0] - glob[0]).norm() + (z[1] - glob[1]).norm()  # the paper's sum over classes 0 and 1 (eq. 5)
    torch.testing.assert_close(algo.loss(ctx(state, payload)), lc + lr)
    state["known"] = torch.tensor([1.0, 1.0, 0.0])
    ld = _soft_ce(torch.cdist(old, tp)[:, :2], d[:, :2], T)
    torch.testing.assert_close(algo.loss(ctx(state, payload)), lc + ld + lr)
    torch.testing.assert_close(distances(z.detach(), glob), torch.cdist(z.detach(), glob), atol=2e-4, rtol=0)


def test_protofcl_paper_loss_by_hand_own_prototypes_classify_and_global_ones_only_pull():
    algo = ProtoFCL(ProtoFCL.Config(alpha=0.5, beta=0.25), Setting(num_classes=3, feature_dim=2, head_keys=HEAD))
    assert algo.cfg.prototypes == "paper"
    z, old, ctx = _protofcl_batch()
    own = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])  # the client's: class 0 only
    glob = torch.tensor([[0.0, 1.0], [2.0, 0.0], [5.0, 5.0]])  # the server's: classes 1 and 2
    payload = {"protos": glob, "has": torch.tensor([0.0, 1.0, 1.0])}
    tp = torch.tensor([[1.0, 0.0], [0.0, 3.0], [0.0, 0.0]])  # the client's own library at its previous task's end
    state = {"protos": own, "has": torch.tensor([1.0, 0.0, 0.0]), "known": torch.tensor([1.0, 1.0, 0.0]),
             "teacher_protos": tp}
    y, T = torch.tensor([0, 1, 2]), algo.cfg.T
    # L_C over its own prototype of class 0 and the batch's (detached) means of classes 1 and 2 — never the server's
    protos = torch.stack([own[0], z[1].detach(), z[2].detach()])
    d = torch.cdist(z, protos)
    lc = torch.nn.functional.cross_entropy(-d / T, y)
    ld = _soft_ce(torch.cdist(old, tp)[:, :2], d[:, :2], T)  # the teacher with its own prototypes, classes 0, 1
    lr = (z[1] - glob[1]).norm() + (z[2] - glob[2]).norm()  # classes in the batch with a global prototype
    loss = algo.loss(ctx(state, payload))
    torch.testing.assert_close(loss, lc + 0.5 * ld + 0.25 * lr)
    # the gradient of L_R reaches the features through the batch's means; L_C's prototypes are detached
    loss.backward()
    zz = z.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(-torch.cdist(zz, protos) / T, y) \
        + 0.5 * _soft_ce(torch.cdist(old, tp)[:, :2], torch.cdist(zz, protos)[:, :2], T) \
        + 0.25 * ((zz[1] - glob[1]).norm() + (zz[2] - glob[2]).norm())
    ref.backward()
    torch.testing.assert_close(z.grad, zz.grad)


def test_protofcl_new_classes_at_the_rounds_start_are_fixed_points_not_the_batchs_moving_mean():
    """new_classes: start — a class the client has no prototype of yet takes its mean over the client's data at the
    round's start (the probe at the received model, ctx.payload["own"]["received"]), not the batch's own mean: fixed
    points cap every logit margin (triangle inequality), so pushing the features outwards no longer pays."""
    algo = ProtoFCL(ProtoFCL.Config(alpha=0.0, beta=0.0, new_classes="start"),
                    Setting(num_classes=3, feature_dim=2, head_keys=HEAD))
    assert [p.at for p in algo.probes(0, {})] == ["received", "final"]
    z, _, ctx = _protofcl_batch()
    own = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    start = {"sum": torch.tensor([[9.0, 9.0], [6.0, 2.0], [0.0, 0.0]]), "count": torch.tensor([3.0, 2.0, 0.0])}
    state = {"protos": own, "has": torch.tensor([1.0, 0.0, 0.0]), "known": torch.zeros(3)}
    payload = {"own": {"received": {"start": start}}}
    # class 0: its own prototype; class 1: its mean at the round's start (3, 1); class 2 (none at the start
    # either): the batch's mean
    protos = torch.stack([own[0], torch.tensor([3.0, 1.0]), z[2].detach()])
    lc = torch.nn.functional.cross_entropy(-torch.cdist(z, protos) / algo.cfg.T, torch.tensor([0, 1, 2]))
    torch.testing.assert_close(algo.loss(ctx(state, payload)), lc)
    # features scaled outwards: with the batch's mean L_C goes to 0, with fixed prototypes it keeps a floor
    batch = ProtoFCL(ProtoFCL.Config(alpha=0.0, beta=0.0), Setting(num_classes=3, feature_dim=2, head_keys=HEAD))
    losses = {"start": [], "batch": []}
    for _ in range(3):
        with torch.no_grad():
            z.mul_(10)
        losses["start"].append(algo.loss(ctx(state, payload)).item())
        losses["batch"].append(batch.loss(ctx(state, {})).item())
    assert losses["batch"][-1] < 1e-6 < 0.1 < min(losses["start"]), losses


def test_protofcl_local_pulls_to_its_own_prototypes_and_sends_nothing():
    algo = ProtoFCL(ProtoFCL.Config(prototypes="local", alpha=0.0, beta=1.0), Setting(num_classes=3, feature_dim=2, head_keys=HEAD))
    z, _, ctx = _protofcl_batch()
    own = torch.tensor([[1.0, 1.0], [3.0, 0.0], [0.0, 0.0]])
    state = {"protos": own, "has": torch.tensor([1.0, 1.0, 0.0]), "known": torch.zeros(3),
             "teacher_protos": torch.zeros(3, 2)}
    protos = torch.stack([own[0], own[1], z[2].detach()])
    lc = torch.nn.functional.cross_entropy(-torch.cdist(z, protos) / algo.cfg.T, torch.tensor([0, 1, 2]))
    lr = (z[0] - own[0]).norm() + (z[1] - own[1]).norm()
    torch.testing.assert_close(algo.loss(ctx(state, {})), lc + lr)
    assert algo.broadcast(algo.init_server([{"w": torch.zeros(1)}]), 0) == {}


@pytest.mark.parametrize("mode,beta,sent", [("paper", 1.0, True), ("paper", 0.0, False), ("global", 0.0, True),
                                            ("local", 1.0, False)])
def test_protofcl_what_travels(mode, beta, sent):
    """The paper's "w/o L_R" exchanges nothing: with beta 0 nothing is broadcast, uploaded or aggregated."""
    algo = ProtoFCL(ProtoFCL.Config(prototypes=mode, beta=beta),
                    Setting(num_classes=3, feature_dim=2, head_keys=HEAD))
    server = algo.init_server([{"w": torch.zeros(1)}])
    assert bool(algo.broadcast(server, 0)) == sent
    state = algo.init_client({"body": torch.zeros(2), "head.weight": torch.zeros(3, 2), "head.bias": torch.zeros(3)})
    stats = {"protos": {"sum": torch.tensor([[2.0, 2.0], [0, 0], [3, 0]]), "count": torch.tensor([2.0, 0, 1])}}
    upload, new = algo.finish({"model": state["model"]}, state, {}, stats)
    assert bool(upload) == sent
    if mode != "global":  # its own library: the round's class means, a class it did not meet keeps none
        torch.testing.assert_close(new["protos"], torch.tensor([[1.0, 1.0], [0, 0], [3, 0]]))
        assert new["has"].tolist() == [1, 0, 1]


def test_protofcl_paper_predicts_with_the_nearest_own_prototype():
    algo = ProtoFCL(setting=Setting(num_classes=3, feature_dim=2, head_keys=HEAD))
    state = {"model": {"head.weight": torch.zeros(3, 2), "head.bias": torch.zeros(3)},
             "protos": torch.tensor([[0.0, 0.0], [4.0, 0.0], [1.0, 0.0]]), "has": torch.tensor([1.0, 1.0, 0.0])}
    p = algo.personal_params(state, {"protos": torch.tensor([[9.0, 9], [9, 9], [1, 0]]), "has": torch.ones(3)})
    z = torch.tensor([[0.9, 0.0], [2.1, 0.0], [3.0, 1.0]])
    pred = (z @ p["head.weight"].T + p["head.bias"]).argmax(1)
    assert pred.tolist() == [0, 1, 1]  # class 2 (no own prototype) is never chosen, the server's never used


@pytest.mark.filterwarnings("ignore:model ResNet has buffers")
@pytest.mark.parametrize("new_classes", ["batch", "start"])
def test_protofcl_prototypes_are_the_class_means_of_the_features_it_predicts_with_batchnorm_at_running_stats(
        new_classes):
    # a BatchNorm model: a prototype at the batch's statistics (training's) lies far from the features prediction
    # compares with it (running statistics): after one round 7.2 apart at a norm of 7.3
    model = {"name": "resnet10", "options": {"norm": "batch", "width": 0.125}}
    fed = train(make_cfg(model=model, train__clients_per_round=4,
                         algorithm={"name": "protofcl", "new_classes": new_classes}), None, rounds=1)
    g, tr = fed.groups[0], fed.split["train"]
    g.module.eval()
    for k in range(4):
        _, classes, task = fed.tasks[k][0]
        rows = torch.as_tensor(tr.ptr[k] + task)
        with torch.no_grad():
            z = g.trainer.apply({n: v[k] for n, v in g.store["model"].items()}, fed.transform(tr.x[rows]),
                                {n: v[k].clone() for n, v in g.buffers.items()})[0]
        for c in classes.tolist():
            torch.testing.assert_close(g.store["protos"][k][c], z[tr.y[rows] == c].mean(0), atol=1e-5, rtol=1e-5)


def test_protofcl_class_means_and_the_pull_of_a_batch_with_a_repeated_and_an_absent_class():
    """Two samples of class 1, one of class 0, none of class 2 (which has a global prototype): L_C's new class is
    the MEAN of its two features, L_R pulls that mean (not each sample) and only for classes in the batch; the
    mean form weighs a class by its samples."""
    z = torch.tensor([[0.0, 0.0], [1.0, 0.0], [3.0, 2.0]], requires_grad=True)
    teacher, student = {"w": torch.tensor(0.0)}, {"w": torch.tensor(1.0)}
    y = torch.tensor([0, 1, 1])
    own = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    glob = torch.tensor([[0.0, 0.0], [2.0, 3.0], [7.0, 7.0]])  # classes 1 and 2 (2 is not in the batch)
    payload = {"protos": glob, "has": torch.tensor([0.0, 1.0, 1.0])}
    state = {"teacher": teacher, "protos": own, "has": torch.tensor([1.0, 0.0, 0.0]), "known": torch.zeros(3),
             "teacher_protos": torch.zeros(3, 2)}
    ctx = LocalContext(lambda params, x, slot=None: (z, z), {"model": student}, state, payload, None, y,
                       torch.ones(3))
    mean1 = (z[1] + z[2]) / 2
    protos = torch.stack([own[0], mean1.detach()])  # class 2: neither its own prototype nor in the batch
    T = 2.0
    lc = torch.nn.functional.cross_entropy(-torch.cdist(z, protos) / T, y)
    for lr_sum, lr in ((True, (mean1 - glob[1]).norm()), (False, 2 * (mean1 - glob[1]).norm() / 3)):
        algo = ProtoFCL(ProtoFCL.Config(alpha=0.0, beta=0.5, T=T, lr_sum=lr_sum),
                        Setting(num_classes=3, feature_dim=2, head_keys=HEAD))
        torch.testing.assert_close(algo.loss(ctx), lc + 0.5 * lr)


def test_protofcl_a_client_keeps_a_class_prototype_until_it_meets_the_class_again():
    """finish: the classes met this round take the round's means; the others keep the prototype they had (the
    memory-free ablation's classes of past tasks rest on this)."""
    algo = ProtoFCL(setting=Setting(num_classes=3, feature_dim=2, head_keys=HEAD))
    state = algo.init_client({"body": torch.zeros(2), "head.weight": torch.zeros(3, 2), "head.bias": torch.zeros(3)})
    state.update(protos=torch.tensor([[5.0, 5.0], [0.0, 0.0], [7.0, 7.0]]), has=torch.tensor([1.0, 0.0, 1.0]))
    stats = {"protos": {"sum": torch.tensor([[0.0, 0.0], [2.0, 4.0], [3.0, 0.0]]),
                        "count": torch.tensor([0.0, 2.0, 3.0])}}
    upload, new = algo.finish({"model": state["model"]}, state, {}, stats)
    torch.testing.assert_close(new["protos"], torch.tensor([[5.0, 5.0], [1.0, 2.0], [1.0, 0.0]]))
    assert new["has"].tolist() == [1, 1, 1]
    assert upload["has"].tolist() == [0, 1, 1]  # it sends only this round's classes


def test_protofcl_global_predicts_with_the_nearest_server_prototype_not_the_head():
    algo = ProtoFCL(ProtoFCL.Config(prototypes="global"), Setting(num_classes=3, feature_dim=2))
    payload = {"protos": torch.tensor([[0.0, 0.0], [4.0, 0.0], [1.0, 0.0]]), "has": torch.tensor([1.0, 1.0, 0.0])}
    z = torch.tensor([[0.9, 0.0], [2.1, 0.0], [3.0, 1.0]])
    head = torch.tensor([[0.0, 0.0, 9.0]] * 3)  # the head's logits would say class 2 everywhere
    assert algo.eval_logits(z, head, payload).argmax(1).tolist() == [0, 1, 1]  # class 2 has no prototype


def test_protofcl_cosine_is_the_paper_loss_on_unit_features_and_cannot_be_lowered_by_scale():
    """distance: cosine (not the paper's): prototypes are means of unit features, every distance (L_C, L_D, L_R) is
    between unit vectors, so scaling the features changes no loss term; prediction is the nearest unit prototype."""
    algo = ProtoFCL(ProtoFCL.Config(alpha=0.5, beta=0.25, T=0.1, distance="cosine"),
                    Setting(num_classes=3, feature_dim=2, head_keys=HEAD))
    z, old, ctx = _protofcl_batch()
    with torch.no_grad():
        z[0] = torch.tensor([3.0, 4.0])  # no zero feature: its direction is undefined
    own = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    glob = torch.tensor([[0.0, 1.0], [2.0, 0.0], [5.0, 5.0]])
    payload = {"protos": glob, "has": torch.tensor([0.0, 1.0, 1.0])}
    tp = torch.tensor([[1.0, 0.0], [0.0, 3.0], [0.0, 0.0]])
    state = {"protos": own, "has": torch.tensor([1.0, 0.0, 0.0]), "known": torch.tensor([1.0, 1.0, 0.0]),
             "teacher_protos": tp}
    unit = lambda v: v / v.norm(dim=-1, keepdim=True)
    u = unit(z)
    protos = torch.stack([unit(own[0]), u[1].detach(), u[2].detach()])
    d = torch.cdist(u, protos)
    lc = torch.nn.functional.cross_entropy(-d / 0.1, torch.tensor([0, 1, 2]))
    ld = _soft_ce(torch.cdist(unit(old), unit(tp[:2])), d[:, :2], 0.1)
    lr = (u[1] - unit(glob[1])).norm() + (u[2] - unit(glob[2])).norm()
    loss = algo.loss(ctx(state, payload))
    torch.testing.assert_close(loss, lc + 0.5 * ld + 0.25 * lr, atol=1e-4, rtol=1e-4)  # (|a|^2+|b|^2-2ab in fp32)
    with torch.no_grad():
        z.mul_(1000)
    torch.testing.assert_close(algo.loss(ctx(state, payload)), loss, atol=1e-4, rtol=1e-4)
    # prediction through the linear head: the nearest unit prototype, whatever the features' scale
    state = {"model": {"head.weight": torch.zeros(3, 2), "head.bias": torch.zeros(3)},
             "protos": torch.tensor([[1.0, 0.0], [0.0, 0.1], [1.0, 1.0]]), "has": torch.tensor([1.0, 1.0, 0.0])}
    p = algo.personal_params(state, {})
    x = torch.tensor([[5.0, 1.0], [0.1, 0.3], [30.0, 40.0]])
    assert (x @ p["head.weight"].T + p["head.bias"]).argmax(1).tolist() == [0, 1, 1]  # Euclidean: [0, 1, 0]
    assert torch.cdist(unit(x), unit(state["protos"][:2])).argmin(1).tolist() == [0, 1, 1]


def test_protofcl_report_measures_the_prototype_geometry():
    algo = ProtoFCL(setting=Setting(num_classes=2, feature_dim=2, head_keys=HEAD))
    protos = torch.tensor([[[0.0, 0.0], [4.0, 0.0]], [[0.0, 1.0], [4.0, 3.0]]])  # two clients, two classes
    out = algo.report({}, {"protos": protos, "has": torch.ones(2, 2)})
    assert out["proto_inter"] == pytest.approx((4 + (16 + 4) ** 0.5) / 2)
    assert out["proto_spread"] == pytest.approx((0.5 + 1.5) / 2)  # class 0: 0.5 from its centre, class 1: 1.5
    assert out["proto_spread_ratio"] == pytest.approx(out["proto_spread"] / out["proto_inter"])
    assert algo.report({}, {"protos": protos, "has": torch.tensor([[1.0, 0], [0, 1]])}) == {}  # nothing to measure


# ---- every method: vectorized == sequential, resume mid-task ------------------------------------------------
FAMILY = [{"name": "protofcl"}, {"name": "protofcl", "prototypes": "global"},
          {"name": "protofcl", "prototypes": "local", "distance": "squared"},
          {"name": "protofcl", "new_classes": "start"}, {"name": "protofcl", "distance": "cosine", "T": 0.1},
          {"name": "fedlwf"}, {"name": "fedewc", "lam": 50.0}, {"name": "fedavg"}, {"name": "glfc"},
          {"name": "glfc", "loss": "bce"}, {"name": "cfed", "review_steps": 3}, {"name": "fedweit", "lam1": 1e-3},
          {"name": "fedsi", "c": 1.0}, {"name": "fedpmr"}, {"name": "fedrecon"}]
SURROGATE = {"source": "noise", "size": 40}  # CFeD's unlabeled stream


@pytest.mark.slow
@pytest.mark.parametrize("algo", FAMILY, ids=lambda a: "-".join(map(str, a.values())))
def test_vectorized_equals_sequential(algo):
    ref = train(make_cfg(algorithm=algo, engine={"backend": "sequential"}, data__public=SURROGATE), None, rounds=5)
    vec = train(make_cfg(algorithm=algo, engine={"backend": "vectorized", "chunk_size": 2}, data__public=SURROGATE),
                None, rounds=5)
    # (five rounds of distances of features: the summation orders of the two paths differ by ~1e-4 relative, and
    # ProtoFCL's L_R — the paper's sum over classes, each distance's gradient not shrinking near 0 — amplifies
    # them to ~5e-4 absolute in a few weights of size ~1)
    tol = {"atol": 1e-3, "rtol": 1e-3} if algo["name"] == "protofcl" else {"atol": 1e-4, "rtol": 1e-3}
    if leaves(ref.groups[0].store):
        assert_trees_close(ref.groups[0].store, vec.groups[0].store, **tol)
    assert_trees_close(ref.server, vec.server, **tol)
    assert all(a.keys() == b.keys() and all((a[c] == b[c]).all() for c in a)
               for a, b in zip(ref.exemplars, vec.exemplars))


@pytest.mark.slow
@pytest.mark.parametrize("algo", FAMILY, ids=lambda a: "-".join(map(str, a.values())))
def test_resume_in_the_middle_of_a_task_equals_uninterrupted(algo, tmp_path):
    cfg = make_cfg(algorithm=algo, data__tasks__rounds_per_task=3, train__rounds=9, data__public=SURROGATE,
                   train__optimizer={"lr": 0.05, "plateau": {"patience": 0, "factor": 0.5}})
    run(cfg, tmp_path / "full", progress=False)
    run(cfg, tmp_path / "cut", progress=False, stop_after=4)  # round 4: the middle of the second task
    run(cfg, tmp_path / "cut", progress=False, resume=True)
    assert strip_timing(read_metrics(tmp_path / "cut")) == strip_timing(read_metrics(tmp_path / "full"))
    s = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert len(s["continual_seen"]) == 3 and len(s["continual_matrix"]) == 3


def test_a_plateau_schedule_that_can_never_fire_is_warned_about():
    with pytest.warns(UserWarning, match="a task of 5 rounds compares 4 losses .* patience 3: the learning rate is"):
        build_federation(make_cfg(data__tasks__rounds_per_task=5, train__optimizer={"plateau": {"patience": 3}}))


def test_the_learning_rate_falls_on_plateaus_and_starts_again_with_each_task():
    fed = build_federation(make_cfg(data__tasks__rounds_per_task=3, train__optimizer={
        "lr": 0.1, "plateau": {"patience": 0, "factor": 0.5, "min_lr": 0.03, "skip": 0}}))
    scales = []
    for t, loss in enumerate([1.0, 1.0, 0.5, 1.0, 0.9, 0.9]):
        fed.srv._track_plateau(t, loss)
        scales.append(fed.plateau["scale"])
    # round 1 makes no progress: halved; round 2 ends the task: a fresh start; round 4 improves, round 5 does not
    # but ends the task
    assert scales == [1.0, 0.5, 1.0, 1.0, 1.0, 1.0] and fed.plateau["best"] == float("inf")
    fed.plateau = {"scale": 0.5, "best": 1.0, "bad": 0}
    for t in (6, 7):  # no progress: 0.25 is below the floor 0.03 / 0.1 = 0.3
        fed.srv._track_plateau(t, 1.0)
        assert fed.plateau["scale"] == pytest.approx(0.3)
    # skip 1: a task's first loss is not compared (not even as the best so far)
    fed = build_federation(make_cfg(data__tasks__rounds_per_task=3, train__optimizer={
        "lr": 0.1, "plateau": {"patience": 0, "factor": 0.5, "skip": 1}}))
    for t, loss in enumerate([0.1, 1.0, 1.0]):
        fed.srv._track_plateau(t, loss)
        if t == 1:
            assert fed.plateau == {"scale": 1.0, "best": 1.0, "bad": 0}
    assert fed.plateau["best"] == float("inf")  # (round 2 cut the rate, then the task ended)


# ---- continual evaluation -----------------------------------------------------------------------------------
@pytest.mark.cpu
def test_continual_accuracy_is_the_global_model_on_the_seen_classes_without_task_id():
    fed = train(make_cfg(algorithm={"name": "fedavg"}), None, rounds=2 * R)
    out = fed.evaluate(2 * R - 1)["continual"]
    x, y = fed.global_test
    seen = fed.seen_classes(1)
    keep = torch.as_tensor(seen)[y]
    with torch.no_grad():
        logits = fed.groups[0].apply(fed.server["model"], fed.transform(x[keep]))[1]
    pred = logits.masked_fill(~torch.as_tensor(seen), float("-inf")).argmax(1)
    ok = (pred == y[keep]).double()
    first = torch.as_tensor(np.isin(y[keep].numpy(), fed.tasks[0][0][1]))
    assert out["stage"] == 1 and out["task_end"]
    assert out["seen_acc"] == pytest.approx(float(ok.mean()))
    assert out["tasks"] == pytest.approx([float(ok[first].mean()), float(ok[~first].mean())])


def test_task_ends_are_always_evaluated_and_summarised_as_an_accuracy_matrix(tmp_path):
    cfg = make_cfg(algorithm={"name": "fedavg"}, train__rounds=6)
    run(cfg, tmp_path / "r", progress=False)
    records = read_metrics(tmp_path / "r")
    assert [r["round"] for r in records if "continual" in r] == [1, 3, 5]
    # the summary's numbers from the matrix, by hand
    rows = [r["continual"]["tasks"] for r in records if "continual" in r]
    s = summarize(records, cfg)
    a = np.full((3, 3), np.nan)
    for i, row in enumerate(rows):
        a[i, : len(row)] = row
    assert s["continual_matrix"][2] == pytest.approx(list(a[2]))
    assert s["continual_bwt"] == pytest.approx(np.mean([a[2, 0] - a[0, 0], a[2, 1] - a[1, 1]]))
    assert s["continual_avg"] == pytest.approx(np.mean([r["continual"]["seen_acc"] for r in records
                                                        if "continual" in r]))


def test_bytes_protofcl_sends_prototypes_not_models():
    fed = build_federation(make_cfg(train__clients_per_round=4))
    rec = fed.round(0)
    C, d = fed.fd.num_classes, 16
    assert rec["payload_bytes_up"] == 4 * 4 * (C * d + C)
    assert rec["payload_bytes_down"] == 4 * 4 * (C * d + C)


# ---- configuration ------------------------------------------------------------------------------------------
def test_memory_and_plateau_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match="exactly one of per_class"):
        make_cfg(data__tasks__memory={"per_class": 2, "total": 10})
    with pytest.raises(ConfigError, match="needs task streams"):
        make_cfg(data__tasks=None, algorithm={"name": "fedavg", "memory": False})
    cfg = make_cfg(compare=[{"name": "fedavg", "memory": False}, {"name": "fedavg"}])
    a, b = cfg.variants()
    assert a.exemplar_memory() is None and b.exemplar_memory().per_class == 3
    assert build_federation(a).exemplars is None and build_federation(b).exemplars is not None


# ---- GLFC, CFeD, FedWeIT by hand ------------------------------------------------------------------------------
def test_glfc_loss_by_hand():
    from fedmosaic.algorithms.glfc import GLFC, GLFCConfig

    algo = GLFC(GLFCConfig(loss="ce"), Setting(num_classes=4))  # the paper's softmax form
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 1.0, 3.0, 0.0], [1.0, 1.0, 0.0, 2.0]], requires_grad=True)
    old = torch.tensor([[1.0, 2.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0], [0.0, 1.0, 5.0, 5.0]])
    teacher, student = {"t": 0}, {"s": 0}

    def apply(params, x, slot=None):
        return None, (logits if params is student else old)

    y = torch.tensor([0, 2, 3])  # class 0 (and 1) old, 2 and 3 new
    state = {"teacher": teacher, "known": torch.tensor([1.0, 1.0, 0.0, 0.0])}
    told = {"task_classes": torch.tensor([0.0, 0, 1, 1]), "memory_classes": torch.tensor([1.0, 1, 0, 0]),
            "seen_classes": torch.ones(4)}  # the client learned 0 and 1 (its memory's); 2 and 3 its task's
    ctx = LocalContext(apply, {"model": student}, state, {"own": told}, None, y, torch.ones(3))
    T, p = algo.cfg.T, logits.softmax(1)
    g = [1 - p[i, y[i]].item() for i in range(3)]  # |p_y - 1|
    w = [1.0, g[1] / ((g[1] + g[2]) / 2), g[2] / ((g[1] + g[2]) / 2)]  # sample 0 alone in the old group
    ce = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    gc = sum(w[i] * ce[i] for i in range(3)) / 3
    p_old = torch.softmax(old[:, :2] / T, 1)  # the teacher over the old classes 0 and 1
    rd = 0
    for i in range(3):
        target = torch.zeros(4)
        target[:2] = p_old[i]
        if y[i] >= 2:
            target[y[i]] += 1
        target = target / target.sum()
        rd = rd - (target * torch.log_softmax(logits[i] / T, 0)).sum()  # seen: classes 0-3
    torch.testing.assert_close(algo.loss(ctx), (gc + rd / 3) / 2)  # the authors' 0.5 / 0.5 at lam = 1
    # the first task: no teacher, so no relation distillation, and nothing learned: every weight 1
    first_told = {**told, "memory_classes": torch.zeros(4)}
    first = LocalContext(apply, {"model": student}, {**state, "known": torch.zeros(4)}, {"own": first_told}, None, y,
                         torch.ones(3))
    torch.testing.assert_close(algo.loss(first), ce.mean())


def test_cfed_reviews_on_the_surrogate_stream_after_learning_the_task():
    fed = build_federation(make_cfg(algorithm={"name": "cfed", "review_steps": 2}, data__public=SURROGATE))
    first, review = fed.algo.program(0)
    assert first.view.part == "all" and review.view.part == "public" and review.steps == 2
    rec = fed.round(0)
    assert rec["local_steps_max"] > 2


def test_fedweit_starts_as_its_base_and_fills_its_knowledge_base_at_each_task_end():
    fed = build_federation(make_cfg(algorithm={"name": "fedweit"}, train__clients_per_round=4))
    g = fed.groups[0]
    mine = fed.personal(g, 0)
    for k, v in fed.server["B"].items():  # the authors' start: mask logits 0 (sigmoid 1/2), A = B_0 / 3, no knowledge
        torch.testing.assert_close(mine[k][0], v / 2 + v / 3)
    model = sum(v.numel() for v in fed.server["B"].values()) * 4  # bytes of one model
    rec = fed.round(0)
    assert fed.server["kb_has"].tolist() == [0.0] * 5
    assert rec["payload_bytes_down"] == 4 * (2 * model + 5 * 4)  # B and B_prev, kb_has; the empty knowledge base: nothing
    fed.round(1)  # the end of task 0
    assert fed.server["kb_has"].tolist() == [1.0, 0, 0, 0, 0]
    for k, a in g.store["A"].items():  # a new task starts as every task: A = B_0 / 3, a fresh mask
        torch.testing.assert_close(a, fed.algo.setting.init[k].expand_as(a) / 3)
    assert all(float(m.abs().sum()) == 0 for m in leaves(g.store["mask"]))
    # the mask task 0 was learned with is kept for the retroactive penalty (it trained away from 0)
    assert all(float(m[:, 0].abs().sum()) > 0 and float(m[:, 1:].abs().sum()) == 0 for m in leaves(g.store["masks"]))
    assert_trees_close(fed.server["B_prev"], fed.server["B"], exact=True)
    # each client keeps the task it learned: the stored entry (the cohort's mean A) mixed in with alpha 1
    assert g.store["alpha"].tolist() == [[1.0, 0, 0, 0, 0]] * 4
    after = fed.personal(g, 1)
    for k, b in fed.server["B"].items():
        torch.testing.assert_close(after[k], (b / 2 + fed.algo.setting.init[k] / 3 + fed.server["kb"][k][0]).expand_as(
            after[k]))
    assert all(float(v[0].abs().sum()) > 0 for v in fed.server["kb"].values())  # (the entry is not empty)
    assert fed.round(2)["payload_bytes_down"] == 4 * (3 * model + 5 * 4)  # one entry more
    fed.round(3)  # the end of task 1
    assert fed.server["kb_has"].tolist() == [1.0, 1.0, 0, 0, 0] and (g.store["alpha"][:, 1] == 1).all()
    # the knowledge base has one entry per task, whatever train.rounds says (a resume may amend it)
    assert build_federation(make_cfg(algorithm={"name": "fedweit"}, train__rounds=3)).server["kb_has"].shape == (5,)


def test_a_continual_comparison_writes_its_matrices_table_and_accuracy_per_task(tmp_path):
    from fedmosaic.reports.compare import run_all, table

    cfg = make_cfg(train__rounds=4, compare=[{"name": "fedavg", "memory": False}, {"name": "protofcl"}])
    summaries = run_all(cfg, tmp_path / "cmp", progress=False)
    for name in ("fedavg_memory=off", "protofcl"):
        assert (tmp_path / "cmp" / name / "accuracy_matrix.png").stat().st_size > 1000
    assert (tmp_path / "cmp" / "accuracy_per_task.png").stat().st_size > 1000
    text = table(summaries)
    assert "CIL avg" in text and "BWT" in text and "fedavg(memory=off)" in text
    assert all(len(s["continual_seen"]) == 2 for s in summaries)


def test_the_task_streams_follow_the_data_seed_and_are_hashed_beside_the_partition():
    """The task streams are part of the data setting: ``data.seed`` keeps them with the partition across run seeds,
    and ``meta.json``'s ``tasks_hash`` tells two streams apart where the partition's hash cannot."""
    from fedmosaic.runs.dirs import tasks_hash

    def streams(**over):
        fed = build_federation(make_cfg(data__tasks__order="random", **over))
        return fed.fd.hash, tasks_hash(fed.tasks)

    assert streams(seed=0, data__seed=7) == streams(seed=1, data__seed=7)
    (p0, t0), (p1, t1) = streams(seed=0), streams(seed=1)
    assert p0 != p1 and t0 != t1
    iid = {"scheme": "iid"}
    assert streams(seed=0, data__seed=7, data__partition=iid)[1] != streams(seed=0, data__seed=8,
                                                                            data__partition=iid)[1]
