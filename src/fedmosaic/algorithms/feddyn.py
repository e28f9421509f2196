"""FedDyn (Acar et al. 2021, "Federated Learning Based on Dynamic Regularization"), the paper's Algorithm 1.

Client k keeps g_k (the gradient of its loss at its last model; zeros at first). Round t, from the global model
theta^(t-1), it minimises

    L_k(theta) - <g_k, theta> + (alpha / 2) ||theta - theta^(t-1)||^2,      then  g_k <- g_k - alpha (theta_k - theta^(t-1)),

and uploads theta_k. The server keeps h (zeros at first):

    h <- h - alpha (1 / N) sum_{k in cohort} (theta_k - theta^(t-1))     (N: every client, not the cohort),
    theta^t = mean_cohort(theta_k) - h / alpha.

The authors' code (alpemreacar/FedDyn, ``utils_methods.py`` ``train_FedDyn``) is the same rule in lambda_k =
-g_k / alpha form. Differences there: the cohort mean is unweighted (here the train-size-weighted mean of every
fedmosaic method, so that alpha = 0 is FedAvg exactly), alpha is scaled per client by its share of the data
(alpha N n_k / sum n), gradients are clipped at norm 10 and weight decay 1e-3 is added; none of these here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import LocalContext, TaskLoss
from ..protocol.tree import leaves, tmap, weighted_mean
from .terms import Prox


class FedDynConfig(AlgoConfig):
    alpha: float = Field(0.01, ge=0, description="the dynamic regulariser's weight (the authors' 1e-2; 0: FedAvg)")


@dataclass(frozen=True)
class Linear:
    """-<g_k, theta>: the linear term of FedDyn's local objective (g_k: the client's state ``g``)."""

    def __call__(self, ctx: LocalContext) -> torch.Tensor:
        w, g = leaves(ctx.params["model"]), leaves(ctx.state["g"])
        return -sum((gi.detach() * wi).sum() for wi, gi in zip(w, g, strict=True))


@register_algorithm
class FedDyn(Algorithm):
    name = "feddyn"
    Config = FedDynConfig

    def init_server(self, init_params):
        model = init_params[0]
        return {"model": model, "h": tmap(torch.zeros_like, model)}

    def init_client(self, init_params):
        return {"g": tmap(torch.zeros_like, init_params)}

    def terms(self):
        return [TaskLoss(), Linear(), Prox(self.cfg.alpha)]

    def finish(self, params, state, payload, stats):
        a = self.cfg.alpha
        g = tmap(lambda g, w, w0: g - a * (w - w0), state["g"], params["model"], payload["global"])
        return {"model": params["model"]}, {"g": g}

    def aggregate(self, server, uploads, weights, round_idx, signals):
        a, mean = self.cfg.alpha, weighted_mean(uploads["model"], weights)
        if a == 0:
            return {**server, "model": mean}
        h = tmap(lambda h, w, w0: h - a / self.trained_clients * (w - w0).sum(0), server["h"], uploads["model"],
                 server["model"])
        return {**server, "model": tmap(lambda m, h: m - h / a, mean, h), "h": h}
