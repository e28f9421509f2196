"""MOON (Li et al.): model-contrastive learning. The local features are pulled toward the global model's features
and pushed away from the client's previous local model's (:class:`~.terms.ModelContrastive`).

The previous local model is persistent client state, initialised with the initial global model and replaced by the
trained model after every round the client takes part in. Models are averaged as FedAvg.
"""

from __future__ import annotations

from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import TaskLoss
from ..protocol.tree import clone
from .terms import ModelContrastive


class MoonConfig(AlgoConfig):
    mu: float = Field(1.0, ge=0, description="weight of the model-contrastive loss (0 = FedAvg)")
    tau: float = Field(0.5, gt=0, description="temperature of the contrastive softmax")


@register_algorithm
class Moon(Algorithm):
    name = "moon"
    Config = MoonConfig

    def init_client(self, init_params):
        return {"prev": clone(init_params)}

    def terms(self):
        return [TaskLoss(), ModelContrastive(self.cfg.mu, self.cfg.tau)]

    def finish(self, params, state, payload, stats):
        return {"model": params["model"]}, {"prev": params["model"]}
