"""APFL (Deng, Kamani, Mahdavi 2020, "Adaptive Personalized Federated Learning") — not the seed APFL-PD: each
client mixes a personal model v with its copy w of the global model, alpha v(x) + (1 - alpha) w(x).

As the authors' code (MLOPTPSU/FedTorch, ``comms/trainings/federated/apfl.py``) does it, every local step on a batch
first takes a step of w on its own loss CE(w(x)), then a step of v on the mixed output's loss
CE(alpha v(x) + (1 - alpha) w(x)) at the updated w (only v moves). w is uploaded and averaged (FedAvg); v stays on
the client. The personal prediction is the mixed output (outputs are mixed, never parameters). alpha = 0: w is
FedAvg's model and the prediction the global model's; alpha = 1: v trains as Local.

Not built: the authors' adaptive alpha (``fed_adaptive_alpha``, off by default there).
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import LocalContext, TaskLoss, per_sample_task_loss
from ..protocol.program import Phase, Step
from ..protocol.tree import clone

PARTS = ("v", "w")


class APFLConfig(AlgoConfig):
    alpha: float = Field(0.5, ge=0, le=1, description="the personal model's share of the mixed output (the "
                         "authors' fed_personal_alpha 0.5; 0: FedAvg, 1: Local)")


@register_algorithm
class APFL(Algorithm):
    name = "apfl"
    Config = APFLConfig
    personalized = True

    def init_client(self, init_params):
        return {"personal": clone(init_params)}

    def local_init(self, payload, state):
        return {"model": payload["global"], "personal": state["personal"]}

    def program(self, round_idx):
        return [Phase(updates=(Step(("model",), objective=self.local), Step(("personal",), objective=self.mixed)))]

    def local(self, ctx: LocalContext) -> torch.Tensor:
        return ctx.term("local", TaskLoss()(ctx))

    def mixed(self, ctx: LocalContext) -> torch.Tensor:
        (_, lv), (_, lw), a = ctx.forward("personal"), ctx.forward("model"), self.cfg.alpha
        return ctx.term("mixed", ctx.mean(per_sample_task_loss(ctx.task_loss, a * lv + (1 - a) * lw, ctx.y)))

    def finish(self, params, state, payload, stats):
        return {"model": params["model"]}, {"personal": params["personal"]}

    def personal_params(self, state, payload):
        return {"v": state["personal"], "w": payload["global"]}

    def personal_forward(self, apply, params, x):
        rest = {k: t for k, t in params.items() if k not in PARTS}  # (the model's buffers)
        (zv, lv), (_, lw) = apply({**params["v"], **rest}, x), apply({**params["w"], **rest}, x)
        return zv, self.cfg.alpha * lv + (1 - self.cfg.alpha) * lw
