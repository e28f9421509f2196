"""FedNova (Wang et al.): normalised averaging, which removes the bias toward clients that take more local steps.

Client i reports its normalised update d_i = (w^t - w_i) / a_i, with a_i the local-step normaliser
(:func:`local_step_normaliser`: tau_i for plain SGD, the momentum-adjusted count with momentum). The server moves by
the effective step count tau_eff = sum_i p_i a_i along the averaged direction:
w^{t+1} = w^t - tau_eff * sum_i p_i d_i, with p_i = n_i / sum_j n_j over the cohort. With equal step counts and plain
SGD this is FedAvg (up to rounding).

``ccvr`` (off by default) is the variant the FedNTD authors ran as "FedNova": every local gradient of client i is
corrected by subtracting the client's normalised update from its previous participation divided by that round's
learning rate, d_i^prev / lr (zero before its first round); the server side is unchanged.
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import TaskLoss
from ..protocol.tree import tmap, weighted_mean
from .terms import GradientShift


def local_step_normaliser(steps: torch.Tensor, optimizer) -> torch.Tensor:
    """a = sum over the local steps of the total weight each gradient ends up with (in units of lr).

    Plain SGD: tau. Heavy-ball momentum rho (PyTorch's buffer, restarted every round):
    a = (tau - rho (1 - rho^tau) / (1 - rho)) / (1 - rho) (FedNova, and SCAFFOLD's momentum-adjusted count).
    Nesterov momentum: the same with the inner rho replaced by rho^2 (each gradient also gets the look-ahead rho).
    Adam has no such count; there (and for ``optimizer=None``) the plain step count is used.
    ``steps`` may be a tensor (one client's count inside a vmapped hook); a client with 0 steps gets 0.
    """
    rho = 0.0 if optimizer is None or optimizer.name != "sgd" else float(optimizer.momentum)
    if rho == 0:
        return steps
    inner = rho * rho if optimizer.nesterov else rho
    return (steps - inner * (1 - rho**steps) / (1 - rho)) / (1 - rho)


class FedNovaConfig(AlgoConfig):
    ccvr: bool = Field(False, description="FedNTD's variant: subtract the client's previous normalised update / lr "
                       "from every local gradient")


@register_algorithm
class FedNova(Algorithm):
    name = "fednova"
    Config = FedNovaConfig

    def init_client(self, init_params):
        return {"shift": tmap(torch.zeros_like, init_params)} if self.cfg.ccvr else {}

    def terms(self):
        return [TaskLoss(), GradientShift("shift")] if self.cfg.ccvr else [TaskLoss()]

    def finish(self, params, state, payload, stats):
        a = local_step_normaliser(stats["steps"], self.optimizer)
        # a >= 1 whenever a step was taken; a client without steps did not move (d = 0)
        d = tmap(lambda g, w: (g - w) / a.clamp(min=1), payload["global"], params["model"])
        if self.cfg.ccvr:  # a client without steps keeps its correction
            state = {"shift": tmap(lambda s, di: torch.where(stats["steps"] > 0, di / stats["lr"], s),
                                   state["shift"], d)}
        return {"d": d, "a": a}, state

    def aggregate(self, server, uploads, weights, round_idx, signals):
        p = weights / weights.sum()
        tau_eff = (p * uploads["a"]).sum()
        direction = weighted_mean(uploads["d"], weights)
        return {**server, "model": tmap(lambda w, d: w - tau_eff * d, server["model"], direction)}
