"""pFedSRB (Liu, Liu, Ji, Yuan 2024): l1-sparse personal parts, a bi-level problem solved per client by scaled ADMM.

min_W (1/M) Σ_m F_m(W),  F_m(W) = min_S f_m(W + S) + beta ||S||_1. Client m starts its round at w = W^t + S_m (S_m
persistent) and runs ``R`` ADMM iterations, each a phase of the round program:

    S ← soft_threshold(w − W^t + u, beta / rho)                      (``before``: per client, mapped)
    w ← approx. argmin f(w) + (rho/2) ||w − S − W^t + u||^2           (the phase's minibatch SGD steps)
    u ← u + w − S − W^t                                               (``after``)

then uploads w; the server takes the paper's plain mean W^{t+1} = (1/M) Σ_m w_m (Algorithm 1) over the cohort's
clients of non-zero weight (one without training samples, or one a robust rule such as Krum drops, is not counted;
``server_mean: samples`` weights the uploads by train size instead, as FedAvg). Global model accuracy uses W, the
personal model is W + S_m. The paper gives no value for rho or R: rho = 1 and R = 5 are our defaults (METHODS.md
§4), both options; u restarts at 0 every round (``reset_u``); each w-step is ``w_steps`` minibatch steps, or
``train.local_epochs`` epochs when unset — so a round costs R times a FedAvg round of the same epochs.

``personal: local`` evaluates each client's last local model w_m (its upload, dense) instead of W + S_m: a reading of
the paper's personalized accuracy that its text does not rule out (its §3 names S_m the personal model), tried as
an explanation of its ordering (docs/results.md: it is not one).

``learn_s: false`` is FedProx (mu = rho): S and u both stay 0 — no S-step and no dual step, as a dual update with S
held at 0 would pull w towards W − Σ(w − W) and undo the local training — so every phase minimises
f(w) + (rho/2) ||w − W^t||^2 from where the last one stopped. With R = 1 that is FedProx exactly; with R > 1 it is
FedProx with R times the local steps, each phase drawing its own batches (its own schedule, not the continuation of
one R-epoch shuffle) and restarting the optimiser's momentum. FedProx weights the mean by train size: compare with
``server_mean: samples``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import LocalContext
from ..protocol.program import Phase
from ..protocol.tree import tmap, weighted_mean
from .terms import sq_dist


class PFedSRBConfig(AlgoConfig):
    beta: float = Field(0.01, ge=0, description="weight of the l1 norm of the personal part S")
    rho: float = Field(1.0, gt=0, description="ADMM penalty rho (the paper gives no value)")
    R: int = Field(5, ge=1, le=10_000, description="ADMM iterations per round (the paper's R; it gives no value)")
    w_steps: int | None = Field(None, ge=1, le=2**31 - 1,
                                description="minibatch steps of each w-update (default: train.local_epochs epochs)")
    reset_u: bool = Field(True, description="restart the scaled dual u at 0 every round (false: keep it)")
    learn_s: bool = Field(True, description="update S and u (false: both stay 0 — FedProx with mu = rho and R times "
                                            "the local steps; with R = 1 and server_mean samples, FedProx exactly)")
    server_mean: Literal["plain", "samples"] = Field(
        "plain", description="the server's mean of the uploads: plain 1/M (the paper) or weighted by train size")
    personal: Literal["global+S", "local"] = Field(
        "global+S", description="the personal model evaluated: W + S_m (as the paper defines it) or the client's "
                                "last local model w_m (dense: what it uploaded; a reading of an evaluation the paper "
                                "does not spell out)")


def soft_threshold(x: torch.Tensor, k: float) -> torch.Tensor:
    return torch.sign(x) * (x.abs() - k).clamp(min=0)


@register_algorithm
class PFedSRB(Algorithm):
    name = "pfedsrb"
    Config = PFedSRBConfig
    personalized = True
    averages = ("model", "model")  # (its plain mean leaves out a weight of 0, as a robust rule's Krum gives)

    def aggregate(self, server, uploads, weights, round_idx, signals):
        w = (weights > 0).to(weights) if self.cfg.server_mean == "plain" else weights  # (0: a client left out)
        return {**server, "model": weighted_mean(uploads["model"], w)}

    def init_client(self, init_params):
        state = {"S": tmap(torch.zeros_like, init_params), "u": tmap(torch.zeros_like, init_params)}
        if self.cfg.personal == "local":  # w: the last local model; W + S until the client has trained once
            state = {**state, "w": tmap(torch.zeros_like, init_params),
                     "trained": next(iter(init_params.values())).new_zeros(())}
        return state

    def local_init(self, payload, state):
        return {"model": tmap(torch.add, payload["global"], state["S"])}

    def loss(self, ctx: LocalContext) -> torch.Tensor:
        """f(w) + (rho/2) ||w - S - W + u||^2, as ||w - c||^2 with the iteration's anchor c = W + S - u (made by its
        S-step: constant during the w-step; W where S = u = 0) — one fused squared difference a tensor
        (``terms.sq_dist``) instead of three subtractions more at every step (the penalty's forward and backward
        2.7x faster on a cohort of MNIST MLPs; the round 1.2x)."""
        w = ctx.params["model"]
        c = ctx.state.get("anchor", ctx.payload["global"])
        pen = sq_dist([w[k] for k in w], [c[k] for k in w])
        return ctx.term("task_loss", ctx.task_loss_of(w)) + ctx.term("admm_penalty", 0.5 * self.cfg.rho * pen)

    def program(self, round_idx):
        if not self.cfg.learn_s:  # S = u = 0: R phases of FedProx's objective around W (see the module docstring)
            return [Phase(steps=self.cfg.w_steps) for _ in range(self.cfg.R)]
        return [Phase(steps=self.cfg.w_steps, before=self.first_s_step if i == 0 else self.s_step,
                      after=self.dual_step) for i in range(self.cfg.R)]

    def s_step(self, params, state, payload):
        """S ← soft_threshold(w − W + u, beta / rho); the w-step's anchor W + S − u."""
        w, W, u = params["model"], payload["global"], state["u"]
        S = {k: soft_threshold(w[k] - W[k] + u[k], self.cfg.beta / self.cfg.rho) for k in w}
        return params, {**state, "S": S, "anchor": {k: W[k] + S[k] - u[k] for k in w}}

    def first_s_step(self, params, state, payload):
        if self.cfg.reset_u:
            state = {**state, "u": tmap(torch.zeros_like, state["u"])}
        return self.s_step(params, state, payload)

    def dual_step(self, params, state, payload):
        """u ← u + w − S − W."""
        w, W, S = params["model"], payload["global"], state["S"]
        return params, {**state, "u": {k: state["u"][k] + w[k] - S[k] - W[k] for k in w}}

    def finish(self, params, state, payload, stats):
        kept = {"S": state["S"], "u": state["u"]}  # (the anchor lives for one w-step)
        if self.cfg.personal == "local":
            kept.update(w=params["model"], trained=torch.ones_like(state["trained"]))
        return {"model": params["model"]}, kept

    def personal_params(self, state, payload):
        mixed = tmap(torch.add, payload["global"], state["S"])
        if self.cfg.personal == "local":
            return {k: torch.where(state["trained"] > 0, state["w"][k], mixed[k]) for k in mixed}
        return mixed

    def client_report(self, state):
        return {"nonzero": sum((t != 0).sum() for t in state["S"].values())}

    def report(self, server, reports):
        """Sparsity of the personal parts: the mean fraction of zeros in S_m and the mean count of non-zeros."""
        nonzero = reports["nonzero"].double()
        total = sum(t.numel() for t in server["model"].values())  # S_m has the model's shapes
        return {"personal_nonzero": float(nonzero.mean()), "personal_sparsity": float(1 - nonzero.mean() / total)}
