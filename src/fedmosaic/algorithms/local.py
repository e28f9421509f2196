"""Local: every client trains its own model and never communicates (the personalization floor)."""

from ..protocol.algorithm import Algorithm, register_algorithm
from ..protocol.tree import clone


@register_algorithm
class Local(Algorithm):
    name = "local"
    personalized = True
    global_model = False

    def init_server(self, init_params):
        return {}

    def broadcast(self, server, round_idx):
        return {}

    def aggregate(self, server, uploads, weights, round_idx, signals):
        return server

    def init_client(self, init_params):
        return {"model": clone(init_params)}

    def local_init(self, payload, state):
        return {"model": state["model"]}

    def finish(self, params, state, payload, stats):
        return {}, {"model": params["model"]}

    def personal_params(self, state, payload):
        return state["model"]
