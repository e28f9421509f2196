"""FedPMR — a RECONSTRUCTION, not the paper's rule: FedWeIT's decomposition plus replay of stored samples with the
probabilities the model gave them ("probability memory recall").

The paper ProtoFCL compares against (Wang et al., "Federated probability memory recall for federated continual
learning", Information Sciences 2023) could not be read here (neither its text nor code is reachable offline);
ProtoFCL describes it as "通过参数分解和回放提升模型的持续学习性能" (parameter decomposition and replay) and, in its
cost comparison, as sending twice the parameters like FedWeIT. This file builds what those words and the name say:

- the decomposition, knowledge base, penalties and server of FedWeIT (``fedweit.py``, every option of it here too);
- replay: the client trains on its current task and its exemplar memory (``data.tasks.memory`` or
  ``algorithm.memory``: per class or in total), the cross-entropy over the task's and the memory's classes;
- probability recall: on the batch's memory samples (those of classes not in the current task), ``recall`` times the
  cross-entropy between the probabilities of the model it predicted with at the end of its previous task (over the
  classes known then, temperature ``T``) and the current composed model's — the probabilities a sample was kept
  with, recalled.

Deviation (docs/design.md): a sample's probabilities are those of the model at the end of the client's previous
task, computed when the sample is replayed, not stored once when it entered the memory — identical for the samples
kept at that task's end, recomputed by a later model for the older ones (the memory keeps sample offsets only, and a
per-sample store in every client's state would grow with the memory). With ``recall: 0`` and no memory it is FedWeIT
exactly.
"""

import torch
from pydantic import Field

from ..protocol.algorithm import register_algorithm
from ..protocol.context import LocalContext
from .continual import KeepsTeacher, soft_ce
from .fedweit import FedWeIT, FedWeITConfig


class FedPMRConfig(FedWeITConfig):
    recall: float = Field(1.0, ge=0, description="weight of the probability recall on the batch's memory samples "
                          "(0: FedWeIT with replay)")
    T: float = Field(2.0, gt=0, description="temperature of the recalled and the current probabilities")


@register_algorithm
class FedPMR(KeepsTeacher, FedWeIT):
    name = "fedpmr"
    Config = FedPMRConfig

    def recall(self, ctx: LocalContext, logits: torch.Tensor) -> torch.Tensor | None:
        if self.cfg.recall == 0:
            return None
        own = ctx.payload["own"]
        replayed = (1 - own["task_classes"][ctx.y]) * ctx.mask  # memory samples: classes of earlier tasks
        known = ctx.state["known"]
        _, old = ctx.teacher(ctx.state["teacher"], "task")
        term = ctx.mean(soft_ce(old, logits, known, self.cfg.T), replayed) * (known.sum() > 0)
        return self.cfg.recall * ctx.term("recall", term)
