"""GLFC (Dong et al., CVPR 2022), global-local forgetting compensation — the parts a task stream with known task
boundaries needs, on FedAvg with the engine's exemplar memory (iCaRL herding):

- class-aware gradient compensation (L_GC): each sample's classification loss is reweighted by the magnitude of its
  gradient at the true logit, |p_y - 1|, normalised by the mean of that magnitude over the batch's samples of its
  group — old classes (those this client has learned: its memory's, as the authors' ``learned_classes``) or new
  ones — so neither group's gradient dominates; weight 1 while the client has learned nothing (its first task);
- class-semantic relation distillation (L_RD): the current model is pulled towards the previous task's model on
  the classes that model knew, and towards the label on the others;
- with a teacher the objective is (L_GC + lam L_RD) / (1 + lam) (the authors' 0.5 / 0.5 at lam = 1), before it L_GC.

``loss: ce`` (default) is the paper's form (eq. 4-6): softmax cross-entropy, p = softmax, and L_RD the
cross-entropy between the teacher's softmax (temperature T) on the old classes with the label on the new,
renormalised, and the current softmax at T. ``loss: bce`` is the authors' code (conditionWang/FCIL, src/GLFC.py
``_compute_loss``, ``efficient_old_class_weight``): sigmoid binary cross-entropy on one-hot targets averaged over
samples and classes, p = sigmoid, and as L_RD's targets the teacher's sigmoids on its classes, the one-hot label on
the rest, no temperature. Why ce by default: that mean over the classes divides each logit's gradient by their
number, which the authors offset with lr 2.0 (src/option.py); a comparison runs every method at one learning rate,
at which bce barely learns (digits, 5 tasks, lr 0.05: 84.5% average incremental accuracy against 95.6% with ce, and
97.9% with bce at lr 0.5). Both are over every class the federation has met (``ce_classes: seen``), the authors'
head, which grows by each task's classes.

Simplified (docs/design.md): GLFC detects task changes by the entropy of predictions, while the engine knows the task
boundaries; its proxy server, which picks the best of recent global models as the teacher by reconstructing samples
from perturbed prototype gradients, is left out — the teacher is the global model at the end of the previous task.
"""

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import CE_CLASSES, LocalContext, onehot, only, per_sample_task_loss
from .continual import UNKNOWN, KeepsTeacher


class GLFCConfig(AlgoConfig):
    lam: float = Field(1.0, ge=0, description="weight of the relation distillation: with a teacher the objective is "
                       "(L_GC + lam L_RD) / (1 + lam), the authors' 0.5 / 0.5 at lam = 1")
    loss: Literal["ce", "bce"] = Field("ce", description="ce: the paper's softmax form at T; bce: the authors' code "
                                       "(sigmoid binary cross-entropy, the teacher's sigmoids as targets: it needs "
                                       "a learning rate about as many times larger as there are classes met)")
    T: float = Field(2.0, gt=0, description="distillation temperature of loss: ce (bce has none)")
    compensate: bool = Field(True, description="class-aware gradient compensation of the classification term")
    ce_classes: CE_CLASSES = Field("seen", description="output columns of both terms: every class the federation "
                                   "has met (the authors' growing head), the current task's (and the memory's), all")


def group_mean(v: torch.Tensor, group: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per sample, the mean of ``v`` over the (real) samples of its group (1: old class, 0: new)."""
    old = (v * group * mask).sum() / (group * mask).sum().clamp(min=1)
    new = (v * (1 - group) * mask).sum() / ((1 - group) * mask).sum().clamp(min=1)
    return group * old + (1 - group) * new


def bce(logits: torch.Tensor, target: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Per sample: the mean over the columns ``cols`` [C] of the sigmoid binary cross-entropy."""
    return (F.binary_cross_entropy_with_logits(logits, target, reduction="none") * cols).sum(-1) / cols.sum()


@register_algorithm
class GLFC(KeepsTeacher, Algorithm):
    name = "glfc"
    Config = GLFCConfig
    needs_tasks = True

    def loss(self, ctx: LocalContext) -> torch.Tensor:
        cfg, known = self.cfg, ctx.state["known"]
        _, logits = ctx.forward()
        keep = ctx.classes(cfg.ce_classes)
        cols = torch.ones_like(known) if keep is None else keep
        hot = onehot(ctx.y, self.num_classes)
        if cfg.loss == "bce":
            gc = bce(logits, hot, cols)
            p_y = torch.sigmoid(logits.gather(1, ctx.y[:, None])[:, 0])
        else:
            gc = per_sample_task_loss("ce", only(logits, keep), ctx.y)
            p_y = only(logits, keep).softmax(-1).gather(1, ctx.y[:, None])[:, 0]
        if cfg.compensate:
            learned = ctx.payload.get("own", {}).get("memory_classes", torch.zeros_like(known))
            g = (1 - p_y).detach()
            w = g / group_mean(g, learned[ctx.y], ctx.mask).clamp(min=1e-12)
            gc = gc * torch.where(learned.sum() > 0, w, torch.ones_like(w))  # nothing learned yet: weight 1
        gc = ctx.mean(gc)
        if not cfg.lam:
            return gc
        _, old = ctx.teacher(ctx.state["teacher"], "task")
        has = (known.sum() > 0).to(gc.dtype)  # no teacher in the first task
        cols = torch.maximum(cols, known)  # (ce_classes: task leaves the teacher's classes out of L_GC only)
        if cfg.loss == "bce":  # the teacher's sigmoids on its classes, the label elsewhere
            rd = bce(logits, torch.where(known > 0, torch.sigmoid(old), hot), cols)
        else:  # old classes: the teacher's softmax; a new class: its label; renormalised
            p_old = torch.where(known > 0, old / cfg.T, UNKNOWN).softmax(-1)
            target = p_old * known + hot * (1 - known[ctx.y])[:, None]
            target = target / target.sum(-1, keepdim=True)
            rd = -(target * only(logits / cfg.T, cols).log_softmax(-1)).sum(-1)
        share = 1 / (1 + cfg.lam * has)
        return ctx.term("gc", share * gc) + ctx.term("rd", share * cfg.lam * has * ctx.mean(rd))
