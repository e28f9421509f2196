"""FedAvgM (Hsu et al.): FedAvg with server momentum. With avg the weighted mean of the client models,
v <- beta v + (w^t - avg) and w^{t+1} = w^t - server_lr * v (the FedNTD reference's update; beta = 0 and
server_lr = 1 is FedAvg up to rounding).
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.tree import tmap, weighted_mean


class FedAvgMConfig(AlgoConfig):
    beta: float = Field(0.9, ge=0, lt=1, description="server momentum")
    server_lr: float = Field(1.0, gt=0, description="server learning rate applied to the momentum buffer")


@register_algorithm
class FedAvgM(Algorithm):
    name = "fedavgm"
    Config = FedAvgMConfig

    def init_server(self, init_params):
        model = init_params[0]
        return {"model": model, "v": tmap(torch.zeros_like, model)}

    def aggregate(self, server, uploads, weights, round_idx, signals):
        avg = weighted_mean(uploads["model"], weights)
        v = tmap(lambda m, w, a: self.cfg.beta * m + (w - a), server["v"], server["model"], avg)
        model = tmap(lambda w, m: w - self.cfg.server_lr * m, server["model"], v)
        return {**server, "model": model, "v": v}
