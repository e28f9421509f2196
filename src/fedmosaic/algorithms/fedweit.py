"""FedWeIT (Yoon et al., ICML 2021): federated weighted inter-client transfer, on a class-incremental task stream.

A client's weights are decomposed per layer into w = B ⊙ σ(m) + A + Σ_j α_j KB_j: B the base parameters (the
only part the server averages), m one mask logit per output unit (its own), A its sparse task-adaptive parameters
(L1 penalty ``lam1``), and the knowledge base KB — the task-adaptive parameters of earlier tasks, sent by the
server — mixed with the client's own attention weights α (trained, starting at 0). At the end of a task the server
stores the cohort's mean A as that task's KB entry and keeps the base B of that moment; every client starts a new
A at 0 and keeps its mask of that moment, and from then on the retroactive penalty ``lam2`` ||(B - B_prev) ⊙
σ(m_prev)||^2 keeps the base from drifting where the previous task's mask used it.

Simplified (docs/design.md): one KB entry per task (the mean of the clients' A's, not every client's, so the
payload grows by one model per task rather than by one per client and task); past tasks' own A's are frozen in
the KB, so their retroactive terms vanish; no L1 on the masks; dense A and B on the wire (bytes count them dense).
"""

import torch
from pydantic import Field

from ..engine.tree import clone, nbytes, tmap, weighted_mean
from .apfl_pd import _unit
from .base import AlgoConfig, Algorithm, register_algorithm
from .terms import LocalContext


class FedWeITConfig(AlgoConfig):
    lam1: float = Field(1e-4, ge=0, description="L1 weight on the task-adaptive parameters A")
    lam2: float = Field(1.0, ge=0, description="weight of the retroactive penalty on the base's drift (the "
                        "paper's 100 is for Adam at lr 1e-3: with SGD the penalty's curvature 2 lam2 must stay "
                        "well below 2 / lr, or the base oscillates and diverges)")
    mask_init: float = Field(4.0, ge=-30, le=30, description="mask logit of every unit at the start (sigmoid 0.982)")


@register_algorithm
class FedWeIT(Algorithm):
    name = "fedweit"
    Config = FedWeITConfig
    global_model = False
    personalized = True

    @property
    def kb_size(self) -> int:
        """Knowledge-base entries: one per task a stream may hold (not derived from train.rounds, which a resume
        may amend: the checkpoint's shapes must not change)."""
        return max(1, self.setting.n_tasks)

    def init_server(self, init_params):
        B = init_params[0]
        dev = next(iter(B.values())).device
        return {"B": B, "B_prev": clone(B), "kb": tmap(lambda v: torch.zeros(self.kb_size, *v.shape, device=dev), B),
                "kb_has": torch.zeros(self.kb_size, device=dev)}

    def broadcast(self, server, round_idx):
        return {"global": server["B"], "B_prev": server["B_prev"], "kb": server["kb"], "kb_has": server["kb_has"]}

    def aggregate(self, server, uploads, weights, round_idx, signals):
        out = {**server, "B": weighted_mean(uploads["B"], weights)}
        R = self.setting.rounds_per_task
        if R and (round_idx + 1) % R == 0:  # a task ends: its adaptive parameters join the knowledge base
            j = min(round_idx // R, self.kb_size - 1)
            A = weighted_mean(uploads["A"], weights)
            out["kb"] = {k: v.index_copy(0, torch.tensor([j], device=v.device), A[k][None])
                         for k, v in server["kb"].items()}
            out["kb_has"] = server["kb_has"].index_fill(0, torch.tensor([j], device=weights.device), 1.0)
            out["B_prev"] = out["B"]
        return out

    def broadcast_bytes(self, payload):
        """The knowledge base's empty entries are not sent: the payload grows by one model per task."""
        empty = self.kb_size - int(payload["kb_has"].sum())
        return nbytes(payload) - empty * nbytes(payload["kb"]) // self.kb_size

    def init_client(self, server, init_params):
        dev = next(iter(init_params.values())).device
        units = {_unit(k): torch.full((v.shape[0],), self.cfg.mask_init, device=dev) for k, v in init_params.items()}
        return {"mask": units, "A": tmap(torch.zeros_like, init_params), "alpha": torch.zeros(self.kb_size, device=dev),
                "mask_prev": clone(units), "has_prev": torch.zeros((), device=dev)}

    def local_init(self, payload, state):
        return {"B": payload["global"], "mask": state["mask"], "A": state["A"], "alpha": state["alpha"]}

    def compose(self, B, mask, A, alpha, kb, kb_has) -> dict:
        """B ⊙ σ(m) + A + Σ_j α_j KB_j (the mask broadcast over each output unit)."""
        w = alpha * kb_has
        out = {}
        for k, b in B.items():
            m = torch.sigmoid(mask[_unit(k)]).view(-1, *([1] * (b.dim() - 1)))
            out[k] = b * m + A[k] + torch.tensordot(w, kb[k], dims=1)
        return out

    def loss(self, ctx: LocalContext) -> torch.Tensor:
        p, pay, st, cfg = ctx.params, ctx.payload, ctx.state, self.cfg
        w = self.compose(p["B"], p["mask"], p["A"], p["alpha"], pay["kb"], pay["kb_has"])
        loss = ctx.task_loss_of(w)
        if cfg.lam1:
            loss = loss + cfg.lam1 * sum(a.abs().sum() for a in p["A"].values())
        if cfg.lam2:
            drift = sum((((b - pay["B_prev"][k]) * torch.sigmoid(st["mask_prev"][_unit(k)]).view(
                -1, *([1] * (b.dim() - 1)))) ** 2).sum() for k, b in p["B"].items())
            loss = loss + cfg.lam2 * st["has_prev"] * drift
        return loss

    def finish(self, params, state, payload, stats):
        return {"B": params["B"], "A": params["A"]}, {**state, "mask": params["mask"], "A": params["A"],
                                                       "alpha": params["alpha"]}

    def end_task(self, state, model, stats, seen, payload):
        """A new task starts a new A at 0; the entry the server just stored from the cohort's A's (the newest:
        entries fill in order) is mixed in with α = 1, so the model keeps the task it learned."""
        newest = torch.arange(self.kb_size, device=payload["kb_has"].device) == payload["kb_has"].sum() - 1
        return {**state, "A": tmap(torch.zeros_like, state["A"]), "alpha": torch.where(newest, 1.0, state["alpha"]),
                "mask_prev": state["mask"], "has_prev": torch.ones_like(state["has_prev"])}

    def personal_params(self, state, server, own):
        return self.compose(server["B"], state["mask"], state["A"], state["alpha"], server["kb"], server["kb_has"])
