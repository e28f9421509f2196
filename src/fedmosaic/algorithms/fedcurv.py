"""FedCurv (Shoham et al.): an EWC-style penalty that keeps the model where the other clients' losses are curved.

After local training client i measures u_i = mean over minibatches of the squared minibatch gradient at its final
parameters (a diagonal Fisher estimate on 500 samples: the engine's probe at the final parameters) and
v_i = u_i * w_i. The server keeps U = sum_k u_k and V = sum_k v_k over the latest (u_k, v_k) of every client seen so
far; each client keeps its own last (u_i, v_i) in its persistent state (zeros at first), so that it trains with
P = U - u_i, Q = V - v_i (:class:`~.terms.CurvaturePenalty`, lambda * (<P, w^2> - 2 <Q, w>)).

Bookkeeping: a client uploads its model and the *changes* (u_i' - u_i, v_i' - v_i); the server adds their sum to
(U, V) out of place. (The reference implementation mutates the running sum in place, aliasing a client's old
contribution; this does not.) Models are averaged as FedAvg.

The probe's size, 500 samples, is the FedNTD reference's (``size``); ``samples`` changes it.
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import TaskLoss
from ..protocol.program import Probe
from ..protocol.tree import tmap, weighted_mean
from .terms import CurvaturePenalty


class FedCurvConfig(AlgoConfig):
    lam: float = Field(1.0, ge=0, description="weight lambda of the curvature penalty (0 = FedAvg)")
    samples: int = Field(500, ge=1, le=2**31 - 1, description="samples of the Fisher estimate (the client's first "
                         "batches of the round)")


@register_algorithm
class FedCurv(Algorithm):
    name = "fedcurv"
    Config = FedCurvConfig

    def init_server(self, init_params):
        model = init_params[0]
        return {"model": model, "U": tmap(torch.zeros_like, model), "V": tmap(torch.zeros_like, model)}

    def broadcast(self, server, round_idx):
        return {"global": server["model"], "U": server["U"], "V": server["V"]}

    def aggregate(self, server, uploads, weights, round_idx, signals):
        return {
            **server,
            "model": weighted_mean(uploads["model"], weights),
            "U": tmap(lambda s, d: s + d.sum(0), server["U"], uploads["du"]),
            "V": tmap(lambda s, d: s + d.sum(0), server["V"], uploads["dv"]),
        }

    def init_client(self, init_params):
        return {"u": tmap(torch.zeros_like, init_params), "v": tmap(torch.zeros_like, init_params)}

    def probes(self, round_idx, payload):
        return [Probe("grad_sq", at="final", samples=self.cfg.samples)]

    def terms(self):
        return [TaskLoss(), CurvaturePenalty(self.cfg.lam)]

    def finish(self, params, state, payload, stats):
        w = params["model"]
        u = stats["grad_sq"]["model"]
        v = tmap(torch.mul, u, w)
        upload = {"model": w, "du": tmap(torch.sub, u, state["u"]), "dv": tmap(torch.sub, v, state["v"])}
        return upload, {"u": u, "v": v}
