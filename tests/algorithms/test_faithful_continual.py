"""Issue 19, items 11-13: the continual baselines as the standard implementations compute them — the classification
term over the current task's classes (PyCIL's LwF / EWC / fine-tuning), GLFC's loss as its authors' code
(conditionWang/FCIL, src/GLFC.py), FedWeIT's retroactive penalty and initialisation as its authors' code
(wyjeong/FedWeIT, models/fedweit/client.py, modules/nets.py). Every expected value is computed by hand here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fedtest import train, with_overrides

from fedmosaic.algorithms.fedweit import FedWeIT, FedWeITConfig
from fedmosaic.algorithms.glfc import GLFC, GLFCConfig
from fedmosaic.protocol.context import LocalContext, TaskLoss
from fedmosaic.protocol.program import Setting

C = 6
TOLD = {"task_classes": torch.tensor([0.0, 0, 1, 1, 0, 0]),  # the client's task: classes 2 and 3
        "memory_classes": torch.tensor([1.0, 0, 0, 0, 0, 0]),  # its memory holds samples of class 0
        "seen_classes": torch.tensor([1.0, 1, 1, 1, 0, 0])}  # the federation met 0-3


def pycil_ce(logits, y, cols):
    """PyCIL's class-incremental cross-entropy: ``cross_entropy(logits[:, cols], targets remapped into cols)``."""
    cols = torch.as_tensor(cols)
    return F.cross_entropy(logits[:, cols], (y[:, None] == cols).int().argmax(1))


def context(logits, y, own=None, apply=None, state=None, params=None):
    apply = apply or (lambda p, x, slot=None: (None, logits))
    payload = {} if own is None else {"own": own}
    return LocalContext(apply, params or {"model": {}}, state or {}, payload, None, y, torch.ones(len(y)))


# ---- item 11: the classification term over the current task's classes --------------------------------------------
def test_the_classification_term_is_over_the_task_the_memory_the_seen_or_all_classes():
    torch.manual_seed(0)
    logits, y = torch.randn(4, C), torch.tensor([2, 3, 3, 0])  # the last one a memory sample
    ctx = context(logits, y, TOLD)
    torch.testing.assert_close(TaskLoss()(ctx), pycil_ce(logits, y, [0, 2, 3]))  # task + memory (default)
    torch.testing.assert_close(TaskLoss(classes="seen")(ctx), pycil_ce(logits, y, [0, 1, 2, 3]))
    torch.testing.assert_close(TaskLoss(classes="all")(ctx), F.cross_entropy(logits, y))
    fine_tune = context(logits[:3], y[:3], {**TOLD, "memory_classes": torch.zeros(C)})  # no memory: PyCIL's finetune
    torch.testing.assert_close(TaskLoss()(fine_tune), pycil_ce(logits[:3], y[:3], [2, 3]))
    torch.testing.assert_close(TaskLoss()(context(logits, y)), F.cross_entropy(logits, y))  # no task stream: all
    # the columns left out get no gradient (PyCIL slices them away)
    w = logits.clone().requires_grad_()
    TaskLoss()(context(w, y, TOLD)).backward()
    assert (w.grad[:, [1, 4, 5]] == 0).all() and (w.grad[:, [0, 2, 3]] != 0).all()


def make_cfg(**over):
    """Four digits clients, five tasks of two classes (one shared order), two rounds each, plain SGD."""
    raw = {
        "seed": 5,
        "data": {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"},
                 "tasks": {"n_tasks": 5, "rounds_per_task": 2}},
        "model": {"name": "mlp", "options": {"hidden": 16}},
        "train": {"rounds": 10, "clients_per_round": 4, "batch_size": 16, "optimizer": {"lr": 0.05}},
        "eval": {"every": 100, "client_test": False},
    }
    return with_overrides(raw, **over)


@pytest.mark.parametrize("algo, moves", [
    ({"name": "fedavg"}, "task"),  # fine-tuning
    ({"name": "fedavg", "memory": {"per_class": 3}}, "task+memory"),  # replay: the memory's classes too
    ({"name": "fedlwf"}, "task+old"),  # distillation over the old classes
    ({"name": "fedewc", "lam": 50.0}, "task"),  # no pull at its anchor; a Fisher of 0 on unmet rows
    ({"name": "cfed", "review_steps": 2}, "task+old"),
    ({"name": "glfc", "memory": {"per_class": 3}}, "task+old"),  # every class met (the authors' head)
], ids=lambda a: a["name"] + ("+memory" if "memory" in a else "") if isinstance(a, dict) else a)
def test_the_output_rows_of_classes_outside_the_term_do_not_move(algo, moves):
    """The first round of task 1 (plain SGD, no weight decay): the classifier's rows of classes outside the terms get
    exactly zero gradient — before, the cross-entropy over every column pushed all of them."""
    cfg = make_cfg(algorithm=algo, data__public={"source": "noise", "size": 40})
    fed = train(cfg, None, rounds=2)
    before = {k: fed.server["model"][k].clone() for k in ("fc.weight", "fc.bias")}
    task0, task1 = (fed.tasks[0][j][1].tolist() for j in (0, 1))
    assert all(st[j][1].tolist() == fed.tasks[0][j][1].tolist() for st in fed.tasks for j in (0, 1))  # one order
    fed.round(2)
    after = fed.server["model"]
    moving = task1 + (task0 if moves != "task" else [])
    for c in range(10):
        same = torch.allclose(after["fc.weight"][c], before["fc.weight"][c], atol=1e-7, rtol=0) and torch.allclose(
            after["fc.bias"][c], before["fc.bias"][c], atol=1e-7, rtol=0)
        assert same == (c not in moving), (c, moving)


# ---- item 12: GLFC as the authors' code -----------------------------------------------------------------------------
def glfc_setup():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0, 0.5, 3.0], [0.0, 1.0, 3.0, 0.0, -2.0, 1.0],
                           [1.0, 1.0, 0.0, 2.0, 0.0, -1.0], [0.5, -1.0, 2.0, 1.0, 1.0, 0.0]])
    old = torch.tensor([[1.0, 2.0, 0.0, 0.0, 1.0, 0.0], [3.0, 0.0, 0.0, 0.0, 0.0, 2.0],
                        [0.0, 1.0, 5.0, 5.0, 0.0, 0.0], [2.0, -1.0, 0.0, 1.0, 0.0, 0.0]])
    student, teacher = {"s": 0}, {"t": 0}

    def apply(params, x, slot=None):
        return None, (logits if params is student else old)

    return logits, old, student, teacher, apply


def authors_glfc(logits, old, y, numclass, learned, old_numclass):
    """conditionWang/FCIL src/GLFC.py ``_compute_loss`` with its ``efficient_old_class_weight``, the head of
    ``numclass`` outputs (the classes met so far, in order), the old model's of ``old_numclass``."""
    out = logits[:, :numclass]
    target = F.one_hot(y, numclass).float()
    g = (torch.sigmoid(out).detach() - target).abs()
    g = (g * target).sum(1).view(-1, 1)
    if learned:
        index1 = torch.isin(y, torch.tensor(learned)).float().view(-1, 1)
        index2 = 1 - index1
        w1 = g * index1 / ((g * index1).sum() / index1.sum()) if index1.sum() else torch.zeros_like(g)
        w2 = g * index2 / ((g * index2).sum() / index2.sum()) if index2.sum() else torch.zeros_like(g)
        w = w1 + w2
    else:
        w = torch.ones_like(g)
    loss_cur = torch.mean(w * F.binary_cross_entropy_with_logits(out, target, reduction="none"))
    if old_numclass == 0:
        return loss_cur
    distill_target = target.clone()
    distill_target[..., :old_numclass] = torch.sigmoid(old[:, :old_numclass])
    loss_old = F.binary_cross_entropy_with_logits(out, distill_target)
    return 0.5 * loss_cur + 0.5 * loss_old


def test_glfc_is_the_authors_sigmoid_bce_with_gradient_compensation_and_relation_distillation():
    logits, old, student, teacher, apply = glfc_setup()
    algo = GLFC(GLFCConfig(loss="bce"), Setting(num_classes=C))
    assert algo.cfg.ce_classes == "seen"
    y = torch.tensor([0, 2, 3, 1])  # 0 and 1: classes this client learned (its memory's); 2 and 3: its task's
    own = {"task_classes": torch.tensor([0.0, 0, 1, 1, 0, 0]), "memory_classes": torch.tensor([1.0, 1, 0, 0, 0, 0]),
           "seen_classes": torch.tensor([1.0, 1, 1, 1, 0, 0])}
    state = {"teacher": teacher, "known": torch.tensor([1.0, 1, 0, 0, 0, 0])}
    ctx = context(logits, y, own, apply, state, {"model": student})
    torch.testing.assert_close(algo.loss(ctx), authors_glfc(logits, old, y, 4, [0, 1], 2))
    assert set(ctx.terms) == {"gc", "rd"}


def test_glfc_compensates_nothing_before_the_client_learned_anything_and_groups_by_its_own_classes():
    logits, old, student, teacher, apply = glfc_setup()
    algo = GLFC(GLFCConfig(loss="bce"), Setting(num_classes=C))
    y = torch.tensor([0, 1, 1, 0])
    own = {"task_classes": torch.tensor([1.0, 1, 0, 0, 0, 0]), "memory_classes": torch.zeros(C),
           "seen_classes": torch.tensor([1.0, 1, 0, 0, 0, 0])}
    first = context(logits, y, own, apply, {"teacher": teacher, "known": torch.zeros(C)}, {"model": student})
    torch.testing.assert_close(algo.loss(first), authors_glfc(logits, old, y, 2, [], 0))  # weight 1: plain BCE
    # random task orders: class 2 was met by another client before (the teacher knows it) but this client learns it
    # now — it is new to this client, as the authors' learned_classes (the classes of its own exemplar sets)
    y = torch.tensor([0, 2, 3, 2])
    own = {"task_classes": torch.tensor([0.0, 0, 1, 1, 0, 0]), "memory_classes": torch.tensor([1.0, 1, 0, 0, 0, 0]),
           "seen_classes": torch.tensor([1.0, 1, 1, 1, 0, 0])}
    known = torch.tensor([1.0, 1, 1, 0, 0, 0])
    ctx = context(logits, y, own, apply, {"teacher": teacher, "known": known}, {"model": student})
    torch.testing.assert_close(algo.loss(ctx), authors_glfc(logits, old, y, 4, [0, 1], 3))


def test_glfc_ce_is_the_papers_softmax_form():
    logits, old, student, teacher, apply = glfc_setup()
    algo = GLFC(setting=Setting(num_classes=C))
    assert algo.cfg.loss == "ce" and algo.cfg.T == 2.0
    y = torch.tensor([0, 2, 3, 1])
    own = {"task_classes": torch.tensor([0.0, 0, 1, 1, 0, 0]), "memory_classes": torch.tensor([1.0, 1, 0, 0, 0, 0]),
           "seen_classes": torch.tensor([1.0, 1, 1, 1, 0, 0])}
    ctx = context(logits, y, own, apply, {"teacher": teacher, "known": torch.tensor([1.0, 1, 0, 0, 0, 0])},
                  {"model": student})
    s = logits[:, :4]  # the classes met so far
    p = s.softmax(1)
    g = 1 - p[torch.arange(4), y]
    old_grp = y < 2
    w = torch.where(old_grp, g / g[old_grp].mean(), g / g[~old_grp].mean())
    gc = (w * F.cross_entropy(s, y, reduction="none")).mean()
    target = torch.zeros(4, 4)
    target[:, :2] = (old[:, :2] / 2).softmax(1)
    target[~old_grp, y[~old_grp]] = 1
    target = target / target.sum(1, keepdim=True)
    rd = -(target * (s / 2).log_softmax(1)).sum(1).mean()
    torch.testing.assert_close(algo.loss(ctx), 0.5 * gc + 0.5 * rd)


# ---- item 13: FedWeIT as the authors' code --------------------------------------------------------------------------
def fedweit_params():
    torch.manual_seed(1)
    B = {"fc.weight": torch.randn(3, 2), "fc.bias": torch.randn(3)}
    return B


def test_fedweit_defaults_and_initialisation_are_the_authors():
    """config.py: lambda_l1 = 1e-3; nets.py ``create_variable``: A = shared / adaptive_factor (3), each task's mask
    drawn around 0 (sigmoid 1/2)."""
    B = fedweit_params()
    algo = FedWeIT(setting=Setting(num_classes=3, n_tasks=3, init=B))  # B_0: the run's initial model
    assert algo.cfg.lam1 == 1e-3
    server = algo.init_server([B])
    st = algo.init_client(B)
    w = algo.compose(B, st["mask"], st["A"], st["alpha"], server["kb"], server["kb_has"])
    for k, b in B.items():
        torch.testing.assert_close(w[k], b * 0.5 + b / 3)
    # the end of task 0: the mask it was learned with is kept; the next task starts as every task does
    trained = {**st, "mask": {"fc": torch.tensor([1.0, -2.0, 3.0])}, "A": {k: v + 1 for k, v in B.items()}}
    payload = {**algo.broadcast(server, 0), "kb_has": torch.tensor([1.0, 0, 0])}
    nxt = algo.end_task(trained, None, {}, None, payload)
    torch.testing.assert_close(nxt["masks"]["fc"], torch.tensor([[1.0, -2.0, 3.0], [0, 0, 0], [0, 0, 0]]))
    torch.testing.assert_close(nxt["mask"]["fc"], torch.zeros(3))
    for k, b in B.items():
        torch.testing.assert_close(nxt["A"][k], b / 3)


def test_fedweits_retroactive_penalty_sums_over_every_earlier_task_as_the_authors():
    """client.py ``loss``: for every earlier task tid, lambda_l2 * l2_loss(sw * sigmoid(mask_tid) + aw_tid -
    prev_body_weights[tid]) with prev_body_weights[tid] = sw_at_task_start * sigmoid(mask_tid) + aw_tid (A_tid frozen):
    lambda_l2 / 2 * sum_tid ||(B - B_prev) * sigmoid(m_tid)||^2 (tf.nn.l2_loss is half the squared norm)."""
    algo = FedWeIT(FedWeITConfig(lam1=0.0, lam2=3.0), Setting(num_classes=3, n_tasks=4))
    B = fedweit_params()
    server = algo.init_server([B])
    B_prev = {k: v - 0.1 * (i + 1) for i, (k, v) in enumerate(B.items())}
    masks = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.0, -0.5], [9.0, 9.0, 9.0], [0, 0, 0]])  # two ended, one not
    kb_has = torch.tensor([1.0, 1.0, 0.0, 0.0])
    st = {**algo.init_client(B), "masks": {"fc": masks}}
    params = {"B": B, "mask": st["mask"], "A": st["A"], "alpha": st["alpha"]}
    payload = {**algo.broadcast(server, 0), "B_prev": B_prev, "kb_has": kb_has,
               "own": {**{k: torch.ones(3) for k in ("task_classes", "seen_classes")},
                       "memory_classes": torch.zeros(3)}}
    x, y = torch.randn(5, 2), torch.tensor([0, 1, 2, 2, 1])

    def apply(p, xb, slot=None):
        return None, xb @ p["fc.weight"].T + p["fc.bias"]

    ctx = LocalContext(apply, params, st, payload, x, y, torch.ones(5))
    algo.loss(ctx)
    tids = [0, 1]
    expected = sum(
        3.0 * 0.5 * (((B["fc.weight"] - B_prev["fc.weight"]) * torch.sigmoid(masks[j])[:, None]) ** 2).sum()
        + 3.0 * 0.5 * (((B["fc.bias"] - B_prev["fc.bias"]) * torch.sigmoid(masks[j])) ** 2).sum() for j in tids)
    torch.testing.assert_close(ctx.terms["drift"], expected)
    # the classification term: the composed model's cross-entropy over the task's classes (the authors' task head)
    w = algo.compose(B, st["mask"], st["A"], st["alpha"], server["kb"], kb_has)
    torch.testing.assert_close(ctx.terms["task_loss"], F.cross_entropy(apply(w, x)[1], y))
    told = {**payload["own"], "task_classes": torch.tensor([0.0, 1, 1])}
    ctx = LocalContext(apply, params, st, {**payload, "own": told}, x[1:], y[1:], torch.ones(4))
    algo.loss(ctx)
    torch.testing.assert_close(ctx.terms["task_loss"], pycil_ce(apply(w, x[1:])[1], y[1:], [1, 2]))


def test_fedewc_fisher_max_clips_each_new_entry_as_pycil():
    import torch

    from fedmosaic.algorithms.fedewc import FedEWC
    from fedmosaic.protocol.program import Setting

    state = {"anchor": {"w": torch.zeros(3)}, "fisher": {"w": torch.tensor([1e-5, 0.0, 0.0])}}
    new = {"fisher": {"model": {"w": torch.tensor([2.0, 1e-6, 5e-4])}}}
    clipped = FedEWC(FedEWC.Config(fisher_max=1e-4), Setting()).end_task(state, {"w": torch.ones(3)}, new, None, {})
    torch.testing.assert_close(clipped["fisher"]["w"], torch.tensor([1e-5 + 1e-4, 1e-6, 1e-4]))
    plain = FedEWC(setting=Setting()).end_task(state, {"w": torch.ones(3)}, new, None, {})
    torch.testing.assert_close(plain["fisher"]["w"], torch.tensor([2.0 + 1e-5, 1e-6, 5e-4]))
