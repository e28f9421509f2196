"""FedProx: FedAvg plus (mu/2)||w - w^t||^2 in the local objective. mu = 0 is FedAvg exactly."""

from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import TaskLoss
from .terms import Prox


class FedProxConfig(AlgoConfig):
    mu: float = Field(0.1, ge=0, description="proximal weight (FedNTD uses 0.1, APFL 1)")


@register_algorithm
class FedProx(Algorithm):
    name = "fedprox"
    Config = FedProxConfig

    def terms(self):
        return [TaskLoss(), Prox(self.cfg.mu)]
