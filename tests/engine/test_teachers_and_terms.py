"""Teachers run frozen (eval mode, their own BatchNorm statistics, never the student's) and every run reports the
named parts of its local objective; ProtoFCL's options and its teacher's entropy."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from fedtest import assert_trees_close, with_overrides
from torch import nn
from torch.func import functional_call

from fedmosaic.algorithms.protofcl import ProtoFCL, distances, entropy_ratio
from fedmosaic.errors import ConfigError
from fedmosaic.models import MODELS, Wrapped, register_model
from fedmosaic.protocol.context import LocalContext
from fedmosaic.protocol.program import Setting
from fedmosaic.protocol.tree import tmap
from fedmosaic.runs.records import TIMING_KEYS, read_metrics, summarize
from fedmosaic.runs.runner import run
from fedmosaic.setup.world import build_federation


def bn_tiny(input_shape, num_classes):
    body = nn.Sequential(nn.Conv2d(input_shape[0], 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return Wrapped(body, nn.Linear(4, num_classes))


if "bn_tiny" not in MODELS:
    register_model("bn_tiny", bn_tiny)


def make_cfg(**over):
    """Four digits clients (sklearn's 8x8 digits), an MLP, two rounds."""
    raw = {
        "seed": 2,
        "data": {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"}},
        "model": {"name": "mlp", "options": {"hidden": 16}},
        "algorithm": {"name": "fedprox", "mu": 0.5},
        "train": {"rounds": 2, "clients_per_round": 3, "batch_size": 32, "optimizer": {"lr": 0.05}},
        "eval": {"every": 1, "client_test": False},
        "checkpoint_every": 1,
    }
    return with_overrides(raw, **over)


def continual(**over):
    return make_cfg(**{"data__tasks": {"n_tasks": 5, "rounds_per_task": 2, "memory": {"per_class": 3}},
                       "algorithm": {"name": "protofcl"}, "train__rounds": 6, **over})


def strip_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


# ---- per-term losses ----------------------------------------------------------------------------------------
def test_the_named_terms_of_the_objective_add_up_to_the_training_loss(tmp_path):
    run(make_cfg(), tmp_path / "r", progress=False)
    for rec in read_metrics(tmp_path / "r"):
        terms = rec["terms"]
        assert set(terms) == {"task_loss", "prox"} and terms["prox"] > 0
        assert math.isclose(terms["task_loss"] + terms["prox"], rec["train_loss"], rel_tol=1e-5)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["terms_last"] == read_metrics(tmp_path / "r")[-1]["terms"]


def test_a_single_term_objective_records_no_terms(tmp_path):
    fed = build_federation(make_cfg(algorithm={"name": "fedavg"}))
    assert "terms" not in fed.round(0)


def test_terms_are_the_same_on_the_vectorized_and_the_sequential_path():
    cfg = {"algorithm": {"name": "fedntd", "beta": 1.0}}
    a = build_federation(make_cfg(engine={"backend": "sequential"}, **cfg)).round(0)["terms"]
    b = build_federation(make_cfg(engine={"backend": "vectorized"}, **cfg)).round(0)["terms"]
    assert a.keys() == b.keys() == {"task_loss", "not_true_distillation"}
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=1e-4)


def test_a_damaged_terms_record_is_dropped_on_read(tmp_path):
    run(make_cfg(), tmp_path / "r", progress=False)
    path = tmp_path / "r" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    last = json.loads(lines[-1])
    last["terms"] = {"task_loss": "nan?"}
    path.write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    with pytest.warns(UserWarning, match="damaged"):
        assert len(read_metrics(tmp_path / "r")) == len(lines) - 1


def test_report_prints_the_terms_table():
    from fedmosaic.reports.compare import terms_table

    s = summarize([{"round": 0, "train_loss": 1.0, "bytes_up": 0, "bytes_down": 0,
                    "terms": {"task_loss": 0.75, "prox": 0.25}}], make_cfg())
    text = terms_table([s, {"name": "fedavg"}])
    assert "task_loss" in text and "0.25" in text and "fedavg" in text.splitlines()[-1]


# ---- teachers: frozen, eval mode, their own statistics ------------------------------------------------------
def test_a_batchnorm_teacher_runs_in_eval_mode_on_its_own_statistics_and_moves_nothing():
    fed = build_federation(make_cfg(model={"name": "bn_tiny"}, engine={"backend": "sequential"},
                              algorithm={"name": "fedntd"}))
    g = fed.groups[0]
    tr = fed.split["train"]
    x = fed.transform(tr.x[:16])
    teacher = tmap(lambda t: t + 0.1 * torch.randn_like(t), fed.server["model"])
    frozen = {k: v + 0.5 for k, v in g.global_buffers.items() if v.is_floating_point()}
    frozen = {**g.global_buffers, **frozen}
    student = tmap(lambda t: t[0].clone(), g.buffers)
    before = tmap(torch.clone, student)
    g.module.train()
    ctx = g.trainer._ctx({"model": fed.server["model"]}, {}, {"global_buffers": frozen, "own": {}}, x, tr.y[:16],
                         torch.ones(16), (), student)
    z, logits = ctx.teacher(teacher, "global")
    g.module.eval()
    want = functional_call(g.module, {**teacher, **frozen}, (x,), {"with_features": True})
    g.module.train()
    torch.testing.assert_close(logits, want[1])
    torch.testing.assert_close(z, want[0])
    assert_trees_close(student, before, exact=True)  # the student's running statistics did not move
    assert not logits.requires_grad and g.module.training
    train_mode = functional_call(g.module, {**teacher, **tmap(torch.clone, frozen)}, (x,), {"with_features": True})
    assert not torch.allclose(train_mode[1], logits)  # (batch statistics would give other logits)


def test_the_continual_teacher_keeps_the_statistics_of_the_end_of_its_task_and_resumes(tmp_path):
    cfg = continual(model={"name": "bn_tiny"}, algorithm={"name": "fedlwf"}, engine={"backend": "sequential"})
    fed = build_federation(cfg)
    g = fed.groups[0]
    initial = tmap(torch.clone, g.task_buffers)
    fed.round(0)
    assert_trees_close(g.task_buffers, initial, exact=True)  # no task has ended: training did not touch them
    fed.round(1)  # the end of task 0: FedLwF's teacher is the global model, with the server's statistics
    assert_trees_close(g.task_buffers, g.global_buffers_like(len(g.clients)), exact=True)
    run(cfg, tmp_path / "full", progress=False)
    run(cfg, tmp_path / "cut", progress=False, stop_after=3)
    run(cfg, tmp_path / "cut", progress=False, resume=True)
    assert strip_timing(read_metrics(tmp_path / "cut")) == strip_timing(read_metrics(tmp_path / "full"))


# ---- ProtoFCL: options and the teacher's entropy ------------------------------------------------------------
def _ctx(algo, z, y, payload, state, old=None):
    student = {"w": torch.tensor(1.0)}

    def apply(params, x, slot=None):
        return (z, z) if params is student else (old, old)

    return LocalContext(apply, {"model": student}, state, payload, None, y, torch.ones(len(y)))


def test_protofcl_squared_distance_and_the_mean_form_of_l_r_by_hand():
    algo = ProtoFCL(ProtoFCL.Config(distance="squared", lr_sum=False, prototypes="global", beta=1.0),
                    setting=Setting(num_classes=3, feature_dim=2))
    z = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    glob = torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 0.0]])
    payload = {"protos": glob, "has": torch.tensor([1.0, 1.0, 0.0])}
    state = {"teacher": {}, "known": torch.zeros(3), "teacher_protos": torch.zeros(3, 2)}
    y = torch.tensor([0, 1, 2])
    ctx = _ctx(algo, z, y, payload, state, old=torch.zeros(3, 2))
    protos = torch.stack([glob[0], glob[1], z[2].detach()])
    d2 = torch.cdist(z, protos) ** 2
    lc = torch.nn.functional.cross_entropy(-d2 / algo.cfg.T, y)
    lr = ((z[0] - glob[0]) ** 2).sum() / 3 + ((z[1] - glob[1]) ** 2).sum() / 3  # mean over the 3 samples
    torch.testing.assert_close(algo.loss(ctx), lc + lr)
    assert set(ctx.terms) == {"l_c", "l_d", "l_r", "teacher_entropy"}
    torch.testing.assert_close(ctx.terms["l_r"], lr.detach())


def test_teacher_entropy_is_one_for_a_flat_teacher_and_falls_as_it_sharpens():
    known = torch.tensor([1.0, 1.0, 1.0, 0.0])
    flat = torch.zeros(2, 4)
    torch.testing.assert_close(entropy_ratio(flat, known), torch.ones(2))
    sharp = torch.tensor([[10.0, 0.0, 0.0, 5.0]])
    p = torch.softmax(torch.tensor([10.0, 0.0, 0.0]), 0)
    torch.testing.assert_close(entropy_ratio(sharp, known), -(p * p.log()).sum()[None] / math.log(3))
    assert float(entropy_ratio(sharp, torch.tensor([1.0, 0, 0, 0]))) == 0.0  # one class: nothing to measure


def test_protofcl_reports_its_terms_and_the_teachers_entropy():
    fed = build_federation(continual())
    recs = [fed.round(t) for t in range(4)]
    assert set(recs[0]["terms"]) == {"l_c", "l_d", "l_r", "teacher_entropy"}
    assert recs[0]["terms"]["teacher_entropy"] == 0 and recs[0]["terms"]["l_d"] == 0  # no teacher yet
    assert 0 < recs[2]["terms"]["teacher_entropy"] <= 1  # task 2: the teacher of task 1


def test_report_every_round_gives_the_geometry_between_evaluations_and_changes_no_number(tmp_path):
    """eval.report_every: 1 puts ProtoFCL's prototype geometry in every round's record (a collapse is seen when
    it happens, not at the task's end); the rounds an evaluation reports are the same numbers, and the rest of
    every record too."""
    every = 3
    run(continual(eval={"every": every, "client_test": False}), tmp_path / "a", progress=False)
    run(continual(eval={"every": every, "client_test": False, "report_every": 1}), tmp_path / "b", progress=False)
    a, b = (strip_timing(read_metrics(tmp_path / d)) for d in "ab")
    assert [("report" in r) for r in a] == [("continual" in r) for r in a] != [True] * 6  # with evaluations only
    assert all("proto_inter" in r["report"] and "proto_spread_ratio" in r["report"] for r in b)
    assert [r["report"] for r in b if "report" in a[r["round"]]] == [r["report"] for r in a if "report" in r]
    assert [{k: v for k, v in r.items() if k != "report"} for r in b] == \
        [{k: v for k, v in r.items() if k != "report"} for r in a]
    assert b[0]["report"] != b[1]["report"]  # measured each round, not repeated
    wire = build_federation(continual(eval={"every": every, "client_test": False, "report_every": 1}), pool="wire")
    wire.round(0)
    assert wire.report(0) == {"report": b[0]["report"]}  # a report-only request crosses the wire as it is


def test_per_task_geometry_and_entropy_by_hand_over_seeds_and_in_the_report(tmp_path):
    """`fedmosaic report` on class-incremental runs gives per task: the seen-class accuracy, the report at the
    task's end (ProtoFCL's geometry) and each term's mean over the task's rounds (the teacher's entropy) — by
    hand from metrics.jsonl (every 3rd round evaluated: the terms' mean is over every round of the task, the
    report the task end's), then the mean ± std over two seeds."""
    from fedmosaic.reports.compare import from_runs, over_seeds, tasks_table

    cfg = continual(eval={"every": 3, "client_test": False})
    for seed in (2, 3):
        run(with_overrides(cfg.model_dump(), seed=seed), tmp_path / f"s{seed}", progress=False)
    recs = read_metrics(tmp_path / "s2")
    tasks = summarize(recs, cfg)["continual_per_task"]
    assert len(tasks) == 3  # 6 rounds, 2 a task
    for i, t in enumerate(tasks):
        mine, end = recs[2 * i: 2 * i + 2], recs[2 * i + 1]
        assert t["seen"] == end["continual"]["seen_acc"] and t["proto_inter"] == end["report"]["proto_inter"]
        assert t["teacher_entropy_mean"] == pytest.approx(np.mean([r["terms"]["teacher_entropy"] for r in mine]))
    assert tasks[0]["teacher_entropy_mean"] == 0 < tasks[1]["teacher_entropy_mean"]  # a teacher from task 2 on
    (both,), _, _ = from_runs([tmp_path / "s2", tmp_path / "s3"])
    other = summarize(read_metrics(tmp_path / "s3"), cfg)["continual_per_task"]
    assert both["seeds"] == 2 and both["continual_per_task"][1]["proto_inter"] == pytest.approx(
        (tasks[1]["proto_inter"] + other[1]["proto_inter"]) / 2)
    assert both["continual_per_task_std"][1]["seen"] == pytest.approx(
        np.std([tasks[1]["seen"], other[1]["seen"]], ddof=1))
    text = tasks_table([both, {"name": "fedavg"}])
    assert "task 3" in text and "proto_spread_ratio" in text and " ± " in text and "fedavg" not in text
    # a seed that stopped early (diverged) leaves the later tasks to the seeds that reached them, and says so
    (cut,) = over_seeds({"p": [{"continual_per_task": tasks}, {"continual_per_task": other[:1]}]})
    assert cut["continual_per_task_seeds"] == [2, 1, 1] and cut["continual_per_task"][2] == tasks[2]
    assert "(1 of 2 seeds)" in tasks_table([cut]) and tasks_table([cut]).count("(1 of 2 seeds)") == 2 * len(tasks[2])
    (none,) = over_seeds({"p": [{"continual_per_task": tasks}, {"continual_avg": 0.1}]})  # one ended no task yet
    assert none["continual_per_task_seeds"] == [1, 1, 1] and none["continual_per_task"] == tasks
    assert tasks_table([{"name": "fedavg"}]) == ""


def test_protofcl_with_local_prototypes_exchanges_nothing_and_predicts_by_its_own_nearest_prototype():
    fed = build_federation(continual(algorithm={"name": "protofcl", "prototypes": "local"}))
    rec = fed.round(0)
    assert rec["payload_bytes_up"] == 0 and rec["payload_bytes_down"] == 0  # only the protocol's bookkeeping travels
    assert float(fed.server["has"].sum()) == 0  # the server library is never filled
    g = fed.groups[0]
    state = tmap(lambda t: t[0], g.store)
    assert float(state["has"].sum()) > 0  # the client's own library
    params = fed.algo.personal_params(state, {**fed.algo.broadcast(fed.server, 0), "own": {}})
    x = fed.transform(fed.split["test"].x[:50]) if len(fed.split["test"].y) else fed.global_test[0][:50]
    z, logits = g.apply(params, x)
    d = torch.where(state["has"] > 0, distances(z, state["protos"]), float("inf"))
    assert (logits.argmax(1) == d.argmin(1)).all()


def test_protofcl_local_prototypes_need_a_linear_head():
    with pytest.raises(ConfigError, match="one linear layer"):
        ProtoFCL(ProtoFCL.Config(prototypes="local"), Setting(num_classes=3, feature_dim=2))


def test_sq_dist_is_the_squared_difference_summed_bit_for_bit_also_mapped():
    """terms.sq_dist (F.mse_loss, summed) gives the numbers of ((a - b) ** 2).sum() exactly — value and gradient, on
    one client's tensors and mapped over a cohort's stacked ones — so FedProx, Ditto, FedDyn and pFedMe kept
    theirs when they moved to it."""
    from torch.func import vmap

    from fedmosaic.algorithms.terms import sq_dist

    g = torch.Generator().manual_seed(0)
    a = [torch.randn(5, 7, 3, generator=g, requires_grad=True), torch.randn(5, 11, generator=g, requires_grad=True)]
    b = [torch.randn(5, 7, 3, generator=g), torch.randn(5, 11, generator=g)]
    plain = lambda x, y: sum(((p - q) ** 2).sum() for p, q in zip(x, y))  # noqa: E731
    for f_new, f_old in [(sq_dist, plain), (vmap(sq_dist), vmap(plain))]:
        new, old = f_new(a, b), f_old(a, b)
        assert torch.equal(new, old)
        for x, y in zip(torch.autograd.grad(new.sum() * 0.35, a), torch.autograd.grad(old.sum() * 0.35, a)):
            assert torch.equal(x, y)
