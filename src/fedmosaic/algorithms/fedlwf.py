"""FedLwF: FedAvg whose clients also distil from the previous task's model (Learning without Forgetting, Li & Hoiem)
on their current data, over the classes that model knew — the class-incremental baseline of ProtoFCL's family.
The teacher is the global model at the end of the previous task, kept by every client (``end_task``); ``lam = 0``
is FedAvg fine-tuning exactly."""

from pydantic import Field

from .base import AlgoConfig, Algorithm, register_algorithm
from .continual import Distill, KeepsTeacher
from .terms import TaskLoss


class FedLwFConfig(AlgoConfig):
    lam: float = Field(1.0, ge=0, description="weight of the distillation term")
    T: float = Field(2.0, gt=0, description="distillation temperature")


@register_algorithm
class FedLwF(KeepsTeacher, Algorithm):
    name = "fedlwf"
    Config = FedLwFConfig

    def terms(self):
        return [TaskLoss(), Distill(self.cfg.lam, self.cfg.T)]
