"""SCAFFOLD (Karimireddy et al.): control variates correct the client drift.

Server control c and client controls c_i (persistent, zeros at first). Locally every gradient is corrected to
g - c_i + c (the :class:`~.terms.ControlVariate` term). After training (option II of the paper):
c_i+ = c_i - c + (w^t - w_i) / (a_i * lr), with a_i the local step count — momentum-adjusted when the optimiser uses
momentum (:func:`.fednova.local_step_normaliser`, as the FedNTD reference does). Clients upload their model and
dc_i = c_i+ - c_i; the server sets c += (|S| / N) * mean_S(dc_i) with N the number of clients, and averages models
as FedAvg (global step size 1).
"""

from __future__ import annotations

import torch

from ..protocol.algorithm import Algorithm, register_algorithm
from ..protocol.context import TaskLoss
from ..protocol.tree import tmap, weighted_mean
from .fednova import local_step_normaliser
from .terms import ControlVariate


@register_algorithm
class Scaffold(Algorithm):
    name = "scaffold"

    def init_server(self, init_params):
        model = init_params[0]
        return {"model": model, "c": tmap(torch.zeros_like, model)}

    def broadcast(self, server, round_idx):
        return {"global": server["model"], "c": server["c"]}

    def aggregate(self, server, uploads, weights, round_idx, signals):
        n = len(weights)
        c = tmap(lambda c, dc: c + (n / self.trained_clients) * dc.mean(0), server["c"], uploads["dc"])
        return {**server, "model": weighted_mean(uploads["model"], weights), "c": c}

    def init_client(self, init_params):
        return {"c": tmap(torch.zeros_like, init_params)}

    def terms(self):
        return [TaskLoss(), ControlVariate()]

    def finish(self, params, state, payload, stats):
        steps = stats["steps"]
        a = local_step_normaliser(steps, self.optimizer).clamp(min=1)
        ran = steps > 0  # a client without local steps keeps its control variate

        def update(ci, c, g, w):
            return torch.where(ran, ci - c + (g - w) / (a * stats["lr"]), ci)

        c_plus = tmap(update, state["c"], payload["c"], payload["global"], params["model"])
        dc = tmap(torch.sub, c_plus, state["c"])
        return {"model": params["model"], "dc": dc}, {"c": c_plus}
