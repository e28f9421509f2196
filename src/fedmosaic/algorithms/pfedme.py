"""pFedMe (Dinh et al. 2020): personalization with Moreau envelopes.

Per minibatch, ``K`` steps on the personal model θ ← θ − eta_p (∇f(θ) + lam (θ − w_loc)), then one step on the local
copy w_loc ← w_loc − eta lam (w_loc − θ) — one step of the round program with K + 1 updates. θ and w_loc start the
round at the global model; the server moves w ← (1 − beta) w + beta · mean(w_loc) (weighted by train size). The
personal model is the client's last θ (the global model for a client that has not trained yet).
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..engine.program import Phase, Step
from ..engine.tree import clone, tmap, weighted_mean
from .base import AlgoConfig, Algorithm, register_algorithm
from .terms import LocalContext


class PFedMeConfig(AlgoConfig):
    lam: float = Field(15.0, ge=0, description="Moreau-envelope weight lambda")
    personal_lr: float = Field(0.09, gt=0, description="step size eta_p of the personal model")
    K: int = Field(5, ge=1, le=1000, description="personal steps per minibatch")
    beta: float = Field(1.0, gt=0, le=2, description="server step: w <- (1 - beta) w + beta * mean(w_loc)")


def _sq_dist(a: dict, b: dict) -> torch.Tensor:
    return sum(((a[k] - b[k]) ** 2).sum() for k in a)


@register_algorithm
class PFedMe(Algorithm):
    name = "pfedme"
    Config = PFedMeConfig
    personalized = True

    def init_client(self, server, init_params):
        return {"theta": clone(init_params), "trained": torch.zeros((), device=next(iter(init_params.values())).device)}

    def local_init(self, payload, state):
        return {"theta": payload["global"], "model": payload["global"]}

    def personal_loss(self, ctx: LocalContext) -> torch.Tensor:
        theta, w = ctx.params["theta"], tmap(torch.detach, ctx.params["model"])
        return ctx.task_loss_of(theta) + 0.5 * self.cfg.lam * _sq_dist(theta, w)

    def local_loss(self, ctx: LocalContext) -> torch.Tensor:
        """Its gradient is lam (w_loc − θ): the w_loc update as a step of the program's optimiser."""
        return 0.5 * self.cfg.lam * _sq_dist(ctx.params["model"], tmap(torch.detach, ctx.params["theta"]))

    def program(self, server, round_idx):
        inner = Step(("theta",), self.personal_loss, lr=self.cfg.personal_lr)
        return [Phase(updates=(inner,) * self.cfg.K + (Step(("model",), self.local_loss),))]

    def aggregate(self, server, uploads, weights, round_idx, signals):
        mean = weighted_mean(uploads["model"], weights)
        b = self.cfg.beta
        return {**server, "model": tmap(lambda w, m: (1 - b) * w + b * m, server["model"], mean)}

    def finish(self, params, state, payload, stats):
        return {"model": params["model"]}, {"theta": params["theta"], "trained": torch.ones_like(state["trained"])}

    def personal_params(self, state, server, own):
        return {k: torch.where(state["trained"] > 0, v, server["model"][k]) for k, v in state["theta"].items()}
