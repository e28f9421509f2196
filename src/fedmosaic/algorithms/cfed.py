"""CFeD (Ma et al., 2022): continual federated learning by knowledge distillation on surrogate data.

Every round a client first learns its current task (cross-entropy on its task samples and memory), then reviews
the old classes: its model is distilled from the previous task's model (kept at every task's end) on a batch stream
of unlabeled surrogate data (``data.public``: another image dataset, or noise), over the classes that model knew —
so old knowledge is rehearsed without old samples. Simplified (docs/design.md): CFeD's server-side distillation
against intra-task forgetting and its split of clients into learners and reviewers are left out; every client both
learns and reviews. The cross-entropy is over the current task's classes (``ce_classes: task``), as LwF-style
class-incremental baselines are run (PyCIL's LwF); CFeD's code is not public.
"""

from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import CE_CLASSES, TaskLoss
from ..protocol.program import Phase, Step, View
from .continual import Distill, KeepsTeacher
from .terms import ce_classes_field


class CFeDConfig(AlgoConfig):
    lam: float = Field(1.0, ge=0, description="weight of the distillation on surrogate data")
    T: float = Field(2.0, gt=0, description="distillation temperature")
    review_steps: int | None = Field(None, ge=1, le=10**6,
                                     description="steps on the surrogate stream per round (None: one pass)")
    ce_classes: CE_CLASSES = ce_classes_field()


@register_algorithm
class CFeD(KeepsTeacher, Algorithm):
    name = "cfed"
    Config = CFeDConfig
    needs_tasks = True
    uses_public = True  # the review phase distils on the surrogate stream

    def terms(self):
        return [TaskLoss(classes=self.cfg.ce_classes)]

    def program(self, round_idx):
        review = Step(objective=Distill(self.cfg.lam, self.cfg.T))  # LwF's term, on the surrogate batches
        return [Phase(), Phase(epochs=1, steps=self.cfg.review_steps, view=View("public"), updates=(review,))]
