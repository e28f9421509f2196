"""FedLwF: FedAvg whose clients also distil from the previous task's model (Learning without Forgetting, Li & Hoiem)
on their current data, over the classes that model knew — the class-incremental baseline of ProtoFCL's family.
The teacher is the global model at the end of the previous task, kept by every client (``end_task``); ``lam = 0``
is FedAvg fine-tuning exactly. The cross-entropy is over the current task's classes (``ce_classes: task``), as
class-incremental LwF is run (PyCIL, models/lwf.py: ``cross_entropy(logits[:, known:], targets - known)``): the
old classes' columns are the distillation's alone, not pushed down by every new sample."""

from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import CE_CLASSES, TaskLoss
from .continual import Distill, KeepsTeacher
from .terms import ce_classes_field


class FedLwFConfig(AlgoConfig):
    lam: float = Field(1.0, ge=0, description="weight of the distillation term")
    T: float = Field(2.0, gt=0, description="distillation temperature")
    ce_classes: CE_CLASSES = ce_classes_field()


@register_algorithm
class FedLwF(KeepsTeacher, Algorithm):
    name = "fedlwf"
    Config = FedLwFConfig
    needs_tasks = True

    def terms(self):
        return [TaskLoss(classes=self.cfg.ce_classes), Distill(self.cfg.lam, self.cfg.T)]
