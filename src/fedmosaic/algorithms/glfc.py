"""GLFC (Dong et al., CVPR 2022), global-local forgetting compensation — the parts a task stream with known task
boundaries needs, on FedAvg with the engine's exemplar memory (iCaRL herding):

- class-aware gradient compensation: each sample's cross-entropy is reweighted by the magnitude of its gradient at
  the true logit, |p_y - 1|, normalised by the mean of that magnitude over the batch's samples of its group — old
  classes (those the previous task's model knew) or new ones — so neither group's gradient dominates (eq. 4);
- class-semantic relation distillation: the current model's softmax (temperature T) over the classes met so far is
  pulled towards the previous task's model's probabilities on the old classes with the sample's label on the new
  ones, renormalised (eq. 5-6), weighted ``lam``.

Simplified (docs/design.md): GLFC detects task changes by the entropy of predictions, while the engine knows the task
boundaries; its proxy server, which picks the best of recent global models as the teacher by reconstructing samples
from perturbed prototype gradients, is left out — the teacher is the global model at the end of the previous task.
"""

import torch
from pydantic import Field

from .base import AlgoConfig, Algorithm, register_algorithm
from .continual import UNKNOWN, KeepsTeacher
from .terms import LocalContext, onehot, per_sample_task_loss


class GLFCConfig(AlgoConfig):
    lam: float = Field(1.0, ge=0, description="weight of the class-semantic relation distillation")
    T: float = Field(2.0, gt=0, description="distillation temperature")
    compensate: bool = Field(True, description="class-aware gradient compensation of the cross-entropy")


def group_mean(v: torch.Tensor, group: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per sample, the mean of ``v`` over the (real) samples of its group (1: old class, 0: new)."""
    old = (v * group * mask).sum() / (group * mask).sum().clamp(min=1)
    new = (v * (1 - group) * mask).sum() / ((1 - group) * mask).sum().clamp(min=1)
    return group * old + (1 - group) * new


@register_algorithm
class GLFC(KeepsTeacher, Algorithm):
    name = "glfc"
    Config = GLFCConfig

    def loss(self, ctx: LocalContext) -> torch.Tensor:
        cfg, known = self.cfg, ctx.state["known"]
        _, logits = ctx.forward()
        ce = per_sample_task_loss("ce", logits, ctx.y)
        group = known[ctx.y]
        if cfg.compensate:
            g = (1 - logits.softmax(-1).gather(1, ctx.y[:, None])[:, 0]).detach()
            ce = ce * g / group_mean(g, group, ctx.mask).clamp(min=1e-12)
        loss = ctx.mean(ce)
        if not cfg.lam:
            return loss
        hot = onehot(ctx.y, self.num_classes)
        _, old = ctx.apply(ctx.state["teacher"], ctx.x)
        p_old = torch.where(known > 0, old.detach() / cfg.T, UNKNOWN).softmax(-1)
        target = p_old * known + hot * (1 - group)[:, None]  # old classes: the teacher; a new class: its label
        target = target / target.sum(-1, keepdim=True)
        seen = torch.maximum(known, onehot(ctx.y, self.num_classes, ctx.mask).amax(0))  # met so far, here or before
        student = torch.where(seen > 0, logits / cfg.T, UNKNOWN).log_softmax(-1)
        return loss + cfg.lam * ctx.mean(-(target * student).sum(-1)) * (known.sum() > 0)  # none in the first task
