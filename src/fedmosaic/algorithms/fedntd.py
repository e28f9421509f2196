"""FedNTD (Lee et al.): local CE plus not-true distillation from the global model received this round, which keeps
the global knowledge about the classes a client does not (or barely) hold (:class:`~.terms.NotTrueDistillation`).
beta = 0 is FedAvg exactly. Models are averaged as FedAvg.
"""

from __future__ import annotations

from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import TaskLoss
from .terms import NotTrueDistillation


class FedNTDConfig(AlgoConfig):
    beta: float = Field(1.0, ge=0, description="weight of the not-true distillation loss (0 = FedAvg)")
    tau: float = Field(1.0, gt=0, description="softmax temperature of the distillation")


@register_algorithm
class FedNTD(Algorithm):
    name = "fedntd"
    Config = FedNTDConfig

    def terms(self):
        return [TaskLoss(), NotTrueDistillation(self.cfg.beta, self.cfg.tau)]
