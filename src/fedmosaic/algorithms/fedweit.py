"""FedWeIT (Yoon et al., ICML 2021): federated weighted inter-client transfer, on a class-incremental task stream.

A client's weights are decomposed per layer into w = B ⊙ σ(m) + A + Σ_j α_j KB_j: B the base parameters (the
only part the server averages), m one mask logit per output unit (its own), A its sparse task-adaptive parameters
(L1 penalty ``lam1``), and the knowledge base KB — the task-adaptive parameters of earlier tasks, sent by the
server — mixed with the client's own attention weights α (trained, starting at 0). At the end of a task the server
stores the cohort's mean A as that task's KB entry and keeps the base B of that moment (B_prev); every client keeps
the mask it learned the task with and starts the next task as the authors start every task (models/fedweit,
modules/nets.py ``create_variable``): A = B_0 / 3 (``a_init`` times the initial base B_0) and a fresh mask
(``mask_init``). From then on the retroactive penalty (lam2 / 2) Σ_j ||(B - B_prev) ⊙ σ(m_j)||^2, summed over every
earlier task j with its own mask m_j, keeps the base from drifting where those tasks used it (the authors'
``approx_loss``: lam2 · l2_loss over every earlier task, whose frozen A_j cancels). The cross-entropy is over the
current task's classes (``ce_classes: task``), as the authors' per-task softmax head.

Simplified (docs/design.md): one KB entry per task (the mean of the clients' A's, not every client's, so the
payload grows by one model per task rather than by one per client and task); past tasks' own A's are frozen in
the KB, so the retroactive penalty is on the base's drift alone (above); the anchor B_prev is the server's base, not
each client's own; one head
and per-layer biases decomposed like the weights (no per-task heads: class-incremental testing has no task id);
a fresh mask starts at a constant (the authors draw it around 0 with std 1/sqrt(units)); dense A and B on the wire;
the knowledge base travels without its empty entries, and B_0 never travels (every side knows the run's initial
model: ``setting.init``).
"""

import torch
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import CE_CLASSES, LocalContext, only, per_sample_task_loss
from ..protocol.tree import clone, tmap, weighted_mean
from .apfl_pd import _unit


class FedWeITConfig(AlgoConfig):
    lam1: float = Field(1e-3, ge=0, description="L1 weight on the task-adaptive parameters A (the authors' 1e-3)")
    lam2: float = Field(1.0, ge=0, description="weight of the retroactive penalty on the base's drift (the "
                        "paper's 100 is for Adam at lr 1e-3: with SGD the penalty's curvature lam2 Σ_j σ(m_j)^2, up "
                        "to lam2 × the tasks so far, must stay well below 2 / lr, or the base oscillates and diverges)")
    a_init: float = Field(1 / 3, ge=0, le=10, description="each task's A starts at a_init × the initial base B_0 "
                          "(the authors' 1/3)")
    mask_init: float = Field(0.0, ge=-30, le=30, description="each task's mask logits start here (sigmoid 0.5: the "
                             "mean of the authors' draw)")
    ce_classes: CE_CLASSES = Field("task", description="output columns of the cross-entropy: the current task's "
                                   "classes (and a memory's), as the authors' per-task heads; seen; all")


@register_algorithm
class FedWeIT(Algorithm):
    name = "fedweit"
    Config = FedWeITConfig
    global_model = False
    shares_weights = True  # the server averages the base B
    needs_tasks = True
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

    def pack_broadcast(self, payload):
        """The knowledge base's entries fill in order: only the filled ones travel (the payload grows by one model
        per task)."""
        filled = int(payload["kb_has"].sum())
        return {**payload, "kb": tmap(lambda v: v[:filled], payload["kb"])}

    def unpack_broadcast(self, body):
        return {**body, "kb": tmap(lambda v: torch.cat([v, v.new_zeros(self.kb_size - len(v), *v.shape[1:])]),
                                   body["kb"])}

    def init_client(self, init_params):
        dev = next(iter(init_params.values())).device
        units = {_unit(k): torch.full((v.shape[0],), self.cfg.mask_init, device=dev) for k, v in init_params.items()}
        return {"mask": units, "A": tmap(lambda v: self.cfg.a_init * v, init_params),
                "alpha": torch.zeros(self.kb_size, device=dev),
                "masks": tmap(lambda m: torch.zeros(self.kb_size, *m.shape, device=dev), units)}  # of ended tasks

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
        _, logits = ctx.apply(w, ctx.x)
        task = per_sample_task_loss(ctx.task_loss, only(logits, ctx.classes(cfg.ce_classes)), ctx.y)
        loss = ctx.term("task_loss", ctx.mean(task, ctx.mask))
        recall = self.recall(ctx, logits)
        if recall is not None:
            loss = loss + recall
        if cfg.lam1:
            loss = loss + ctx.term("l1", cfg.lam1 * sum(a.abs().sum() for a in p["A"].values()))
        if cfg.lam2:  # Σ_j ||(B - B_prev) ⊙ σ(m_j)||^2 = Σ_units (Σ_j σ(m_j)^2) ||(B - B_prev)_unit||^2, j: ended tasks
            s = {u: torch.tensordot(pay["kb_has"], torch.sigmoid(m) ** 2, dims=1) for u, m in st["masks"].items()}
            drift = sum((s[_unit(k)].view(-1, *([1] * (b.dim() - 1))) * (b - pay["B_prev"][k]) ** 2).sum()
                        for k, b in p["B"].items())
            loss = loss + ctx.term("drift", 0.5 * cfg.lam2 * drift)
        return loss

    def recall(self, ctx: LocalContext, logits: torch.Tensor) -> torch.Tensor | None:
        """A term on the composed model's ``logits`` of this batch (FedPMR's replay of stored probabilities); none."""
        return None

    def finish(self, params, state, payload, stats):
        return {"B": params["B"], "A": params["A"]}, {**state, "mask": params["mask"], "A": params["A"],
                                                       "alpha": params["alpha"]}

    def end_task(self, state, model, stats, seen, payload):
        """The task's mask is kept (at the index of the entry the server just stored: entries fill in order) for the
        retroactive penalty; the next task starts as the authors start every task, A = a_init B_0 and a fresh mask;
        the entry just stored from the cohort's A's is mixed in with α = 1, so the model keeps the task it learned."""
        newest = torch.arange(self.kb_size, device=payload["kb_has"].device) == payload["kb_has"].sum() - 1
        return {**state, "A": tmap(lambda v: self.cfg.a_init * v, self.setting.init),
                "mask": tmap(lambda m: torch.full_like(m, self.cfg.mask_init), state["mask"]),
                "masks": tmap(lambda ms, m: torch.where(newest.view(-1, 1), m, ms), state["masks"], state["mask"]),
                "alpha": torch.where(newest, 1.0, state["alpha"])}

    def personal_params(self, state, payload):
        return self.compose(payload["global"], state["mask"], state["A"], state["alpha"], payload["kb"],
                            payload["kb_has"])
