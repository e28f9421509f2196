"""FedDF (Lin et al. 2020): ensemble distillation on the public stream toward the mean of the cohort's softmax
outputs, KL(ensemble || student) at temperature ``tau``.

``feddf`` (heterogeneous mode): each client distils itself toward the ensemble of the cohort's round-start outputs,
then trains with CE on its private data — with one architecture per client and no global model, each client distils
itself, as HtFL libraries do. ``feddf_global`` (the original, one shared architecture): clients train the global
model with CE as in FedAvg; the server averages their models and then distils the average toward the ensemble of
the uploaded models (``public_epochs`` passes over the stream, the clients' optimiser and learning rate).
"""

import torch
from pydantic import Field

from ..engine.program import Phase, Step
from .base import Algorithm, register_algorithm
from .exchange import PUBLIC, ExchangeConfig, LogitExchange


class FedDFConfig(ExchangeConfig):
    tau: float = Field(1.0, gt=0, le=100, description="distillation temperature")


@register_algorithm
class FedDF(LogitExchange):
    name = "feddf"
    Config = FedDFConfig

    def exchange(self, server, logits, clients, round_idx):
        return ensemble(logits, self.cfg.tau)

    def collaborate(self, ctx):
        return distill_to_ensemble(ctx, self.cfg.tau)


def ensemble(logits: torch.Tensor, tau: float) -> dict:
    return {"ensemble": torch.softmax(logits / tau, -1).mean(0)}


def distill_to_ensemble(ctx, tau: float) -> torch.Tensor:
    """tau^2 KL(ensemble || softmax(student / tau)) over the public batch (the ensemble rows ``ctx.y``)."""
    _, s = ctx.forward()
    t = ctx.payload["ensemble"][ctx.y]
    kl = (t * (t.clamp(min=1e-12).log() - torch.log_softmax(s / tau, -1))).sum(-1)
    return tau * tau * ctx.mean(kl)


@register_algorithm
class FedDFGlobal(Algorithm):
    name = "feddf_global"
    Config = FedDFConfig  # public_epochs: the server's passes over the stream

    def exchange(self, server, logits, clients, round_idx):
        return ensemble(logits, self.cfg.tau)

    def server_program(self, server, round_idx):
        return [Phase(view=PUBLIC, epochs=self.cfg.public_epochs, batch=self.cfg.public_batch,
                      updates=(Step(("model",), self.distill),))]

    def distill(self, ctx):  # (a method, not a lambda: equal Steps share one cached mapped function)
        return distill_to_ensemble(ctx, self.cfg.tau)
