"""APFL-PD (Ni, Shen, Zhang 2022): personalization by parameter decomposition, with online EWC on the shared part.

Per layer a client's effective weights are ``w_S ⊙ σ(m_k) + w_k``: ``w_S`` shared (the only part sent to the server),
``m_k`` one logit per output unit (a Linear layer's row, a Conv layer's output channel; the layer's bias uses the
same unit's mask), ``w_k`` client-specific. ``m_k`` and ``w_k`` never leave the client. Before round ``z`` a client
trains plain ``w_S``; from round ``z`` on, all three together, on

    L_k(w_S ⊙ σ(m_k) + w_k) + (mu/2) Σ_j F_j (w_S,j − w_S,j^t)^2

Importance (online EWC, eq. 5): F ← lam·F + Σ_k p_k (∇L_k(w_S) at the received global model)^2, refreshed only when
the server sees a loss plateau (:func:`plateau_step`: a sliding window of the rounds' training losses; a "peak"
when the window mean exceeds the last plateau's mean + std, then a refresh when mean < delta_mu and std < delta_sigma)
— the clients of the round after return the gradient at the model they received (an engine probe) — and in the first
``refresh_first`` rounds. Evaluation: each client's decomposed model with the current w_S, the global model for a
client that has none yet.

The detector's loss is the one the paper plots (Fig. 2, "training loss"; the framework it was built on, litian96/
FedProx ``flearn/trainers/fedavg.py``, logs Σ_k n_k L_k(W^t) / Σ_k n_k): the task loss of the GLOBAL model w_S^t on the
clients' training data, a per-sample mean, without the masks, the private parts or the EWC term. Each cohort client
measures it at the model it received (a ``sums`` probe: one extra forward pass) and sends it with its upload (one
number); the server weights them by n_k. So round t's entry is the loss of w_S^t over round t's cohort (FedProx's
log: over all clients). delta is on that scale: CE starts at ln 10 = 2.30 on 10 classes, where (1, 0.5) and (1, 0.2)
bite; the paper's Vehicle (700, 400) cannot be a per-sample hinge loss on standardised features (about 1).

Decisions (METHODS.md §4): ``init: zero`` (w_k = 0, σ(m_k) ≈ 1: the model is unchanged at the switch) is the default;
``init: copy`` is the paper's m_k = 1, w_k = w_S^t (σ(m_k) cannot be exactly 1; ``mask_init`` is its logit), which
doubles the weights at the switch. Decomposition starts at round ``z`` (METHODS.md; the paper's Algorithm 1 writes
t − z > 0). The plateau test needs a full window (``window`` rounds, default 5).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import LocalContext
from ..protocol.program import Phase, Probe, Step
from ..protocol.tree import tmap, weighted_mean


class APFLConfig(AlgoConfig):
    z: int = Field(2, ge=0, le=2**31 - 1, description="round from which clients decompose their model")
    mu: float = Field(1.0, ge=0, description="weight of the EWC penalty on the shared part")
    lam: float = Field(1.0, ge=0, le=1, description="online EWC: weight of the previous importance")
    init: Literal["zero", "copy"] = Field("zero", description="w_k at the switch: 0 (function-preserving) or the "
                                          "received w_S (the paper's Algorithm 1)")
    mask_init: float = Field(4.0, ge=-30, le=30, description="logit of every mask unit at the switch (sigmoid 0.982)")
    learn_mask: bool = Field(True, description="train the masks m_k (false: held at mask_init)")
    learn_private: bool = Field(True, description="train the client-specific part w_k (false: held)")
    window: int = Field(5, ge=1, le=10_000, description="rounds in the plateau detector's sliding window")
    delta_mu: float = Field(1.0, gt=0, description="plateau: window mean of the global model's training loss (a "
                            "per-sample mean, without the EWC term) below this")
    delta_sigma: float = Field(0.5, gt=0, description="plateau: window std of that loss below this")
    refresh_first: int = Field(3, ge=0, le=2**31 - 1, description="refresh the importance in the first N rounds")


def plateau_step(det: dict, loss: float, window: int, delta_mu: float, delta_sigma: float) -> tuple[dict, bool]:
    """One round of the loss-plateau detector (Algorithm 1, lines 9-16). ``det``: ``losses`` (the window, oldest
    first), ``peak``, ``mu_old``, ``sigma_old``. Returns the new detector and whether to refresh the importance."""
    losses = (list(det["losses"]) + [float(loss)])[-window:]
    out = {**det, "losses": losses}
    if len(losses) < window:
        return out, False
    t = torch.tensor(losses, dtype=torch.float64)  # host: the detector's window of Python floats
    mean, std = float(t.mean()), float(t.std(unbiased=False))
    refresh = bool(det["peak"]) and mean < delta_mu and std < delta_sigma
    if refresh:
        out.update(mu_old=mean, sigma_old=std, peak=False)
    if not out["peak"] and mean > out["mu_old"] + out["sigma_old"]:
        out["peak"] = True
    return out, refresh


def _unit(name: str) -> str:
    """The mask a parameter uses: its module's (``fc.weight`` and ``fc.bias`` share ``fc``)."""
    return name.rsplit(".", 1)[0]


@register_algorithm
class APFLPD(Algorithm):
    name = "apfl_pd"
    Config = APFLConfig
    personalized = True

    # ---- server --------------------------------------------------------------------------------------
    def init_server(self, init_params):
        model = init_params[0]
        dev = next(iter(model.values())).device
        scalar = lambda v: torch.tensor(v, dtype=torch.float64, device=dev)
        return {"model": model, "F": tmap(torch.zeros_like, model),
                # the plateau detector, as fixed-shape tensors (checkpoints compare layouts)
                "losses": torch.zeros(self.cfg.window, dtype=torch.float64, device=dev), "seen": scalar(0),
                "peak": scalar(0), "mu_old": scalar(0), "sigma_old": scalar(0), "flag": scalar(0),
                "plateaus": scalar(0)}

    def broadcast(self, server, round_idx):
        on = torch.tensor(float(round_idx >= self.cfg.z), device=server["flag"].device)
        # whether the cohort measures the gradients that refresh F this round (eq. 5): the first rounds, and after
        # the detector saw a plateau
        refresh = torch.tensor(round_idx < self.cfg.refresh_first, device=on.device) | (server["flag"] > 0)
        return {"global": server["model"], "F": server["F"], "decompose": on, "refresh": refresh}

    def aggregate(self, server, uploads, weights, round_idx, signals):
        out = {**server, "model": weighted_mean(uploads["model"], weights)}
        if "g2" in uploads:  # eq. 5, with the gradients at the model the clients received
            out["F"] = tmap(lambda f, g: self.cfg.lam * f + g, server["F"], weighted_mean(uploads["g2"], weights))
            out["flag"] = torch.zeros_like(server["flag"])
        n = int(server["seen"])
        det = {"losses": server["losses"][:n].tolist(),
               "peak": bool(server["peak"]), "mu_old": float(server["mu_old"]), "sigma_old": float(server["sigma_old"])}
        # the global model's training loss, n-weighted (not signals.loss: the running loss of local training, EWC in)
        loss = float((uploads["global_loss"] * weights).sum() / weights.sum())
        det, refresh = plateau_step(det, loss, self.cfg.window, self.cfg.delta_mu, self.cfg.delta_sigma)
        losses = torch.zeros_like(server["losses"])
        losses[: len(det["losses"])] = torch.tensor(det["losses"], dtype=losses.dtype)  # host: copied over
        like = lambda v: torch.full_like(server["peak"], float(v))
        out.update(losses=losses, seen=like(len(det["losses"])), peak=like(det["peak"]), mu_old=like(det["mu_old"]),
                   sigma_old=like(det["sigma_old"]))
        if refresh:
            out.update(flag=like(1), plateaus=server["plateaus"] + 1)
        return out

    # ---- client --------------------------------------------------------------------------------------
    def init_client(self, init_params):
        model = init_params
        units = {_unit(k): torch.zeros(v.shape[0], device=v.device) for k, v in model.items()}
        return {"mask": units, "private": tmap(torch.zeros_like, model),
                "started": torch.zeros((), device=next(iter(model.values())).device)}

    def local_init(self, payload, state):
        fresh = state["started"] == 0
        w_s = payload["global"]
        start = (lambda w: w) if self.cfg.init == "copy" else torch.zeros_like
        return {
            "shared": w_s,
            "mask": tmap(lambda m: torch.where(fresh, torch.full_like(m, self.cfg.mask_init), m), state["mask"]),
            "private": {k: torch.where(fresh, start(w_s[k]), v) for k, v in state["private"].items()},
        }

    @staticmethod
    def compose(shared: dict, mask: dict, private: dict) -> dict:
        """w_S ⊙ σ(m) + w_k, the mask broadcast over each output unit."""
        out = {}
        for k, w in shared.items():
            m = torch.sigmoid(mask[_unit(k)]).view(-1, *([1] * (w.dim() - 1)))
            out[k] = w * m + private[k]
        return out

    def _ewc(self, ctx: LocalContext) -> torch.Tensor:
        if self.cfg.mu == 0:
            return ctx.zero()
        pen = sum((f * (w - g) ** 2).sum() for w, g, f in zip(ctx.params["shared"].values(),
                                                               ctx.payload["global"].values(),
                                                               ctx.payload["F"].values(), strict=True))
        return 0.5 * self.cfg.mu * pen

    def plain_loss(self, ctx: LocalContext) -> torch.Tensor:
        return ctx.term("task_loss", ctx.task_loss_of(ctx.params["shared"])) + ctx.term("ewc", self._ewc(ctx))

    def loss(self, ctx: LocalContext) -> torch.Tensor:
        p = ctx.params
        task = ctx.task_loss_of(self.compose(p["shared"], p["mask"], p["private"]))
        return ctx.term("task_loss", task) + ctx.term("ewc", self._ewc(ctx))

    def received_loss(self, ctx: LocalContext) -> torch.Tensor:
        return ctx.task_loss_of(ctx.params["shared"])

    def global_loss_sums(self, ctx: LocalContext) -> dict:
        """The summed task loss of the shared (global) model on this batch, and the batch's sample count."""
        n = ctx.mask.sum()
        return {"sum": self.received_loss(ctx) * n, "n": n}

    def program(self, round_idx):
        if round_idx < self.cfg.z:
            return [Phase(updates=(Step(("shared",), self.plain_loss),))]
        slots = ("shared",) + ("mask",) * self.cfg.learn_mask + ("private",) * self.cfg.learn_private
        return [Phase(updates=(Step(slots),))]

    def probes(self, round_idx, payload):
        loss = Probe("global_loss", at="received", kind="sums", objective=self.global_loss_sums)
        if not bool(payload["refresh"]):
            return [loss]
        return [loss, Probe("grad", at="received", kind="grad", objective=self.received_loss, slots=("shared",))]

    def finish(self, params, state, payload, stats):
        sums = stats["global_loss"]
        upload = {"model": params["shared"], "global_loss": sums["sum"] / sums["n"].clamp(min=1)}
        if "grad" in stats:
            upload["g2"] = tmap(lambda g: g * g, stats["grad"]["shared"])
        on = payload["decompose"]
        keep = lambda new, old: tmap(lambda a, b: torch.where(on > 0, a, b), new, old)
        new_state = {"mask": keep(params["mask"], state["mask"]), "private": keep(params["private"], state["private"]),
                     "started": torch.maximum(state["started"], on)}
        return upload, new_state

    def report(self, server, reports):
        """The newest entry of the detector's window (the global model's training loss) and the plateaus seen."""
        seen = int(server["seen"])
        newest = {"global_train_loss": float(server["losses"][seen - 1])} if seen else {}
        return {**newest, "plateaus": float(server["plateaus"])}

    def personal_params(self, state, payload):
        w_s = payload["global"]
        mine = self.compose(w_s, state["mask"], state["private"])
        return {k: torch.where(state["started"] > 0, mine[k], w_s[k]) for k in w_s}
