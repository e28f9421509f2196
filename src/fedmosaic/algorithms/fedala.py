"""FedALA (Zhang et al. 2023): adaptive local aggregation of the global model into each client's local model.

A client keeps its local model w_loc and, for the top ``p`` parameter tensors, element-wise weights A in [0, 1]
(ones at first, persistent). On receiving w_glob it first learns A on a random ``sample`` fraction of its train data
(one pass; projected SGD at rate ``eta``: A ← clip(A − eta ∇_A L(mix), 0, 1)) with

    mix = w_loc + (w_glob − w_loc) ⊙ A   for the top p tensors,   w_glob   for the others,

then starts its local training from mix, uploads the trained model and keeps it as w_loc (its personal model). The
first time a client trains, w_loc = w_glob, so A cannot move and mix = w_glob. Simplification: the paper trains A to
convergence (loss std < 0.1 over 10 passes) at a client's first aggregation; here it takes one pass every round,
which at that first time moves nothing anyway (w_loc = w_glob).
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..engine.program import Phase, Step, View
from .base import AlgoConfig, Algorithm, register_algorithm
from .terms import LocalContext


class FedALAConfig(AlgoConfig):
    p: int = Field(2, ge=0, le=10_000, description="parameter tensors, counted from the output, that are mixed")
    eta: float = Field(1.0, gt=0, description="learning rate of the aggregation weights A")
    sample: float = Field(0.8, gt=0, le=1, description="fraction of the train split A is learned on (each round)")


@register_algorithm
class FedALA(Algorithm):
    name = "fedala"
    Config = FedALAConfig
    personalized = True

    def _top(self, model: dict) -> list[str]:
        names = list(model)
        return names[len(names) - min(self.cfg.p, len(names)):]

    def init_client(self, server, init_params):
        dev = next(iter(init_params.values())).device
        return {"local": {k: v.clone() for k, v in init_params.items()},
                "A": {k: torch.ones_like(init_params[k]) for k in self._top(init_params)},
                "seen": torch.zeros((), device=dev)}

    def _mix(self, A: dict, local: dict, glob: dict) -> dict:
        return {k: local[k] + (g - local[k]) * A[k] if k in A else g for k, g in glob.items()}

    def _local(self, state, payload) -> dict:
        return {k: torch.where(state["seen"] > 0, v, payload["global"][k]) for k, v in state["local"].items()}

    def local_init(self, payload, state):
        return {"model": payload["global"], "A": state["A"]}

    def ala_loss(self, ctx: LocalContext) -> torch.Tensor:
        return ctx.task_loss_of(self._mix(ctx.params["A"], self._local(ctx.state, ctx.payload), ctx.payload["global"]))

    def start_from_mix(self, params, state, payload):
        return {**params, "model": self._mix(params["A"], self._local(state, payload), payload["global"])}, state

    def program(self, server, round_idx):
        ala = Step(("A",), self.ala_loss, lr=self.cfg.eta, clamp=(0.0, 1.0))
        return [Phase(epochs=1, view=View("sample", self.cfg.sample), updates=(ala,), after=self.start_from_mix,
                      key=1),
                Phase(updates=(Step(("model",)),), key=0)]

    def finish(self, params, state, payload, stats):
        return {"model": params["model"]}, {"local": params["model"], "A": params["A"],
                                            "seen": torch.ones_like(state["seen"])}

    def personal_params(self, state, server, own):
        return {k: torch.where(state["seen"] > 0, v, server["model"][k]) for k, v in state["local"].items()}
