"""Ditto: a persistent personal model v per client, v <- v - eta (grad f(v) + lambda (v - w^t)), next to the shared
copy that does plain local SGD. Both are trained on the same batches; their gradients do not interact, so summing
the two objectives trains them exactly as two separate loops would. lambda = 0 is purely local training of v.
"""

from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import TaskLoss
from ..protocol.tree import clone
from .terms import Prox


class DittoConfig(AlgoConfig):
    lam: float = Field(0.1, ge=0, description="pull of the personal model toward the global model")


@register_algorithm
class Ditto(Algorithm):
    name = "ditto"
    personalized = True
    Config = DittoConfig

    def init_client(self, init_params):
        return {"personal": clone(init_params)}

    def local_init(self, payload, state):
        return {"model": payload["global"], "personal": state["personal"]}

    def terms(self):
        return [TaskLoss("model"), TaskLoss("personal"), Prox(self.cfg.lam, slot="personal", ref="global")]

    def finish(self, params, state, payload, stats):
        return {"model": params["model"]}, {"personal": params["personal"]}

    def personal_params(self, state, payload):
        return state["personal"]
