"""What the class-incremental algorithms share: the previous task's model kept as a teacher, and distillation from
it over the classes it knew (FedLwF, ProtoFCL)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..protocol.context import UNKNOWN, LocalContext  # UNKNOWN: what a class the teacher never met scores
from ..protocol.tree import clone


def soft_ce(teacher: torch.Tensor, student: torch.Tensor, known: torch.Tensor, T: float) -> torch.Tensor:
    """Per sample: the cross-entropy between softmax(teacher / T) and softmax(student / T), both over the classes
    ``known`` [C] (1/0) only."""
    keep = known > 0
    t = torch.where(keep, teacher.detach() / T, UNKNOWN).softmax(-1)
    s = torch.where(keep, student / T, UNKNOWN).log_softmax(-1)
    return -(t * s).sum(-1)


class KeepsTeacher:
    """Mixin: every client keeps the model it predicted with at the end of its previous task (``teacher``) and the
    classes the federation had met by then (``known``); both start empty (no teacher in the first task)."""

    def init_client(self, init_params):
        dev = next(iter(init_params.values())).device
        return {**super().init_client(init_params), "teacher": clone(init_params),
                "known": torch.zeros(self.num_classes, device=dev)}

    def end_task(self, state, model, stats, seen, payload):
        return {**super().end_task(state, model, stats, seen, payload), "teacher": model, "known": seen}


@dataclass(frozen=True)
class Distill:
    """LwF: lam * CE(softmax(teacher logits / T), softmax(logits / T)) over the classes the teacher knew, on the
    current batch; 0 while there is no teacher (the first task)."""

    lam: float
    T: float = 2.0
    slot: str = "model"

    def __call__(self, ctx: LocalContext) -> torch.Tensor:
        if self.lam == 0:
            return ctx.zero()
        _, logits = ctx.forward(self.slot)
        known = ctx.state["known"]
        _, old = ctx.teacher(ctx.state["teacher"], "task")
        return self.lam * ctx.mean(soft_ce(old, logits, known, self.T)) * (known.sum() > 0)
