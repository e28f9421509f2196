"""FedDF (Lin et al. 2020), heterogeneous mode: ensemble distillation on the public stream, done by each client —
KL(mean of the cohort's softmax outputs || the client's), temperature ``tau`` — then CE on its private data.
(The original distils one shared global model on the server; with one architecture per client group and no global
model, each client distils itself, as HtFL libraries do.)"""

import torch
from pydantic import Field

from .base import register_algorithm
from .exchange import ExchangeConfig, LogitExchange


class FedDFConfig(ExchangeConfig):
    tau: float = Field(1.0, gt=0, le=100, description="distillation temperature")


@register_algorithm
class FedDF(LogitExchange):
    name = "feddf"
    Config = FedDFConfig

    def exchange(self, server, logits, clients, round_idx):
        return {"ensemble": torch.softmax(logits / self.cfg.tau, -1).mean(0)}

    def collaborate(self, ctx):
        _, s = ctx.forward()
        t, tau = ctx.payload["ensemble"][ctx.y], self.cfg.tau
        kl = (t * (t.clamp(min=1e-12).log() - torch.log_softmax(s / tau, -1))).sum(-1)
        return tau * tau * ctx.mean(kl)
