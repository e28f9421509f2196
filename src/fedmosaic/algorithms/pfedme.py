"""pFedMe (Dinh et al. 2020): personalization with Moreau envelopes.

Per minibatch, ``K`` steps on the personal model θ ← θ − eta_p (∇f(θ) + lam (θ − w_loc) + mu θ), then one step on
the local copy w_loc ← w_loc − eta lam (w_loc − θ) (eta: the round's learning rate) — one step of the round program
with K + 1 updates, all plain gradient steps as in the paper (never the run's momentum, weight decay or Adam state).
θ and w_loc start the round at the global model. A round is ``R`` minibatches (the paper's local rounds, as the
authors' ``local_epochs``; METHODS.md: R = 20) or, with ``R: null``, ``train.local_epochs`` passes over the client's
data (the same number of batches as the other methods of a comparison). The server moves
w ← (1 − beta) w + beta · mean(w_loc) (weighted by train size; beta > 1 extrapolates: the paper's study of beta
goes to 4, see the authors' README).
The personal model is the client's last θ (the global model for a client that has not trained yet).

Compared with the authors' code (CharlieDinh/pFedMe, FLAlgorithms/users/userpFedMe.py, optimizers/fedoptimizer.py):
their θ step carries mu = 0.001 (``mu`` here, default 0 as in the paper); they train every client each round and
aggregate a sampled subset (here only the cohort trains); their minibatches run through the client's data in stored
order, unshuffled, one iterator across rounds (here each round draws a fresh permutation).
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import LocalContext
from ..protocol.program import Phase, Step
from ..protocol.tree import clone, tmap, weighted_mean
from .terms import sq_dist


class PFedMeConfig(AlgoConfig):
    lam: float = Field(15.0, ge=0, description="Moreau-envelope weight lambda")
    personal_lr: float = Field(0.09, gt=0, description="step size eta_p of the personal model")
    K: int = Field(5, ge=1, le=1000, description="personal steps per minibatch")
    beta: float = Field(1.0, gt=0, le=10, description="server step: w <- (1 - beta) w + beta * mean(w_loc)")
    R: int | None = Field(None, ge=1, le=100_000, description="local rounds (minibatches) per round; None: "
                                                               "train.local_epochs passes over the data")
    mu: float = Field(0.0, ge=0, description="L2 weight on theta in its steps (the authors' code: 0.001)")


def _sq_dist(a: dict, b: dict) -> torch.Tensor:
    return sq_dist([a[k] for k in a], [b[k] for k in a])


@register_algorithm
class PFedMe(Algorithm):
    name = "pfedme"
    Config = PFedMeConfig
    personalized = True

    def init_client(self, init_params):
        return {"theta": clone(init_params), "trained": torch.zeros((), device=next(iter(init_params.values())).device)}

    def local_init(self, payload, state):
        return {"theta": payload["global"], "model": payload["global"]}

    def personal_loss(self, ctx: LocalContext) -> torch.Tensor:
        theta, w = ctx.params["theta"], tmap(torch.detach, ctx.params["model"])
        loss = ctx.term("ce", ctx.task_loss_of(theta)) + ctx.term("moreau", 0.5 * self.cfg.lam * _sq_dist(theta, w))
        if self.cfg.mu:
            loss = loss + ctx.term("l2", 0.5 * self.cfg.mu * sum((t**2).sum() for t in theta.values()))
        return loss

    def local_loss(self, ctx: LocalContext) -> torch.Tensor:
        """Its gradient is lam (w_loc − θ): the w_loc update as a plain step at the round's learning rate."""
        return 0.5 * self.cfg.lam * _sq_dist(ctx.params["model"], tmap(torch.detach, ctx.params["theta"]))

    def program(self, round_idx):
        inner = Step(("theta",), self.personal_loss, lr=self.cfg.personal_lr, plain=True)
        outer = Step(("model",), self.local_loss, plain=True)
        return [Phase(steps=self.cfg.R, updates=(inner,) * self.cfg.K + (outer,))]

    def aggregate(self, server, uploads, weights, round_idx, signals):
        mean = weighted_mean(uploads["model"], weights)
        b = self.cfg.beta
        return {**server, "model": tmap(lambda w, m: (1 - b) * w + b * m, server["model"], mean)}

    def finish(self, params, state, payload, stats):
        return {"model": params["model"]}, {"theta": params["theta"], "trained": torch.ones_like(state["trained"])}

    def personal_params(self, state, payload):
        return {k: torch.where(state["trained"] > 0, v, payload["global"][k]) for k, v in state["theta"].items()}
