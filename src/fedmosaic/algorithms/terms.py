"""Reusable pieces of local objectives. A term maps a :class:`LocalContext` to a scalar; objectives are sums of terms.

Write each term once, test it once, reuse it everywhere (FedProx = task loss + Prox; FedProto = task loss +
PrototypeMSE; later FedNTD = task loss + not-true distillation, and so on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pydantic import Field

from ..protocol.context import LocalContext, onehot
from ..protocol.tree import leaves


def class_sums(ctx: LocalContext, num_classes: int, slot: str | tuple[str, ...] = "model", unit: bool = False) -> dict:
    """Per class the sum of the batch's features of the model in ``slot`` (``unit``: L2-normalised first) and the
    number of (real) samples: prototypes are their ratio (FedProto, FedPAC, ProtoFCL)."""
    z, _ = ctx.forward(slot)
    z = F.normalize(z, dim=-1) if unit else z
    hot = onehot(ctx.y, num_classes, ctx.mask).to(z.dtype)
    return {"sum": hot.T @ z, "count": hot.sum(0)}


def linear_head(tree: dict, head_keys) -> tuple[str, str]:
    """The names of the [C, d] weight and the [C] bias of a head that is one linear layer (``Setting.head_keys``)."""
    w, b = sorted(head_keys, key=lambda k: -tree[k].dim())
    return w, b


def ce_classes_field():
    """The ``ce_classes`` option of the class-incremental baselines that train the current task's classes."""
    return Field("task", description="output columns of the cross-entropy: the current task's classes (and a "
                 "memory's), every class met so far (seen), or all")


def sq_dist(a: list, b: list) -> torch.Tensor:
    """The sum over paired tensors of ||a_i - b_i||^2, each as ``F.mse_loss(reduction="sum")``: one kernel per
    tensor forward and one backward, where ``((a - b) ** 2).sum()`` runs three and three — the same numbers bit for
    bit (the difference squared as a product, summed in the same order; the gradient 2 (a - b) g), at ~2.3x the
    speed on a cohort's stacked parameters: the proximal terms of FedProx, Ditto, FedDyn, pFedMe and pFedSRB cost
    as much as a small model's forward and backward pass."""
    return sum(F.mse_loss(x, y, reduction="sum") for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class Prox:
    """(mu/2) ||w_slot - ref||^2 with ``ref`` a tree in the payload (FedProx, Ditto, pFedMe)."""

    mu: float
    slot: str = "model"
    ref: str = "global"

    def __call__(self, ctx: LocalContext) -> torch.Tensor:
        if self.mu == 0:
            return ctx.zero()
        w, r = leaves(ctx.params[self.slot]), leaves(ctx.payload[self.ref])
        return 0.5 * self.mu * sq_dist(w, r)


@dataclass(frozen=True)
class L2:
    """(lam/2) ||w_slot||^2 restricted to weight matrices (e.g. the SVM's 0.01 ||W||^2)."""

    lam: float
    slot: str = "model"

    def __call__(self, ctx: LocalContext) -> torch.Tensor:
        ws = [t for t in leaves(ctx.params[self.slot]) if t.dim() >= 2]
        return 0.5 * self.lam * sum((w * w).sum() for w in ws)


@dataclass(frozen=True)
class PrototypeMSE:
    """lam * MSE(feature, global prototype of its class), only for samples whose class has a global prototype.

    ``protos`` [C, d] and ``has`` [C] come from the payload (FedProto; ProtoFCL's regulariser is its cousin).
    """

    lam: float
    slot: str | tuple[str, ...] = "model"

    def __call__(self, ctx: LocalContext) -> torch.Tensor:
        z, _ = ctx.forward(self.slot)
        target = ctx.payload["protos"][ctx.y]
        known = ctx.payload["has"][ctx.y]
        per_sample = ((z - target) ** 2).mean(1) * known
        return self.lam * ctx.mean(per_sample)


def not_true_columns(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """[B, C-1] indices of every class except the true one, in increasing order (vmap-safe: no boolean indexing)."""
    j = torch.arange(num_classes - 1, device=y.device)
    return j + (j >= y[:, None]).to(j.dtype)


@dataclass(frozen=True)
class NotTrueDistillation:
    """FedNTD's not-true distillation: beta * tau^2 * KL(teacher || student) over the not-true classes.

    Student and teacher logits lose their true-class column (the remaining C-1 are renormalised by the softmax at
    temperature ``tau``); the teacher is the model in ``ctx.payload[teacher]`` (the global model received this
    round), detached. The KL is summed over classes and averaged over the (real) samples. The true-class logit of
    the student receives exactly zero gradient from this term.
    """

    beta: float
    tau: float = 1.0
    slot: str = "model"
    teacher: str = "global"

    def __call__(self, ctx: LocalContext) -> torch.Tensor:
        if self.beta == 0:
            return ctx.zero()
        _, logits = ctx.forward(self.slot)
        _, t_logits = ctx.teacher(ctx.payload[self.teacher], "global")
        idx = not_true_columns(ctx.y, logits.shape[-1])
        log_s = F.log_softmax(logits.gather(1, idx) / self.tau, dim=1)
        log_t = F.log_softmax(t_logits.gather(1, idx) / self.tau, dim=1)
        kl = (log_t.exp() * (log_t - log_s)).sum(1)
        return self.beta * self.tau**2 * ctx.mean(kl)


@dataclass(frozen=True)
class CurvaturePenalty:
    """FedCurv: lam * (<P, w^2> - 2 <Q, w>) with P = U - u_i and Q = V - v_i.

    ``U``/``V`` (payload) are the server's sums of every client's latest u_k = E[g^2] and v_k = u_k * w_k; ``u``/``v``
    (the client's persistent state) are its own last ones, so P and Q cover the other clients only. Up to a constant
    this is lam * sum_{k != i} (w - w_k)^T diag(u_k) (w - w_k). That constant (sum_k <u_k, w_k^2>) cannot be had from
    the sums, so the value reported adds <Q^2 / P, 1> (detached) instead: lam * <P, (w - Q/P)^2>, never negative and 0
    at the curvature-weighted mean of the other clients' models (the penalty measured from its minimum; the gradient
    is the paper's).
    """

    lam: float
    slot: str = "model"

    def __call__(self, ctx: LocalContext) -> torch.Tensor:
        if self.lam == 0:
            return ctx.zero()
        w = leaves(ctx.params[self.slot])
        U, V = leaves(ctx.payload["U"]), leaves(ctx.payload["V"])
        u, v = leaves(ctx.state["u"]), leaves(ctx.state["v"])
        total = 0
        for wi, Ui, ui, Vi, vi in zip(w, U, u, V, v, strict=True):
            P, Q = (Ui - ui).detach(), (Vi - vi).detach()
            floor = torch.where(P > 0, Q * Q / torch.where(P > 0, P, 1.0), 0.0).sum()  # -min_w of the two terms
            total = total + (P * wi * wi).sum() - 2 * (Q * wi).sum() + floor
        return self.lam * total


@dataclass(frozen=True)
class ControlVariate:
    """SCAFFOLD's correction as a linear term <c - c_i, w>: its gradient adds (c - c_i) to the local gradient, which
    is the reference's "g - c_i + c before the optimiser step". ``c`` is ``ctx.payload[server]``, ``c_i``
    ``ctx.state[client]``. It is evaluated as <c - c_i, w - stopgrad(w)>, whose value is exactly 0 (so the reported
    training loss stays the task loss) and whose gradient is the same."""

    slot: str = "model"
    server: str = "c"
    client: str = "c"

    def __call__(self, ctx: LocalContext) -> torch.Tensor:
        c, ci = leaves(ctx.payload[self.server]), leaves(ctx.state[self.client])
        return _shift(leaves(ctx.params[self.slot]), [a - b for a, b in zip(c, ci, strict=True)])


def _shift(w: list, direction: list) -> torch.Tensor:
    """<direction, w - stopgrad(w)>: exactly 0, with gradient ``direction`` (added to every local gradient)."""
    return sum((d.detach() * (wi - wi.detach())).sum() for wi, d in zip(w, direction, strict=True))


@dataclass(frozen=True)
class GradientShift:
    """Subtracts ``ctx.state[key]`` from every local gradient of ``slot`` (value 0, like :class:`ControlVariate`):
    FedNova's ``ccvr`` variant."""

    key: str
    slot: str = "model"

    def __call__(self, ctx: LocalContext) -> torch.Tensor:
        return _shift(leaves(ctx.params[self.slot]), [-s for s in leaves(ctx.state[self.key])])


@dataclass(frozen=True)
class ModelContrastive:
    """MOON: mu * CE([cos(z, z_glob), cos(z, z_prev)] / tau, target 0), averaged over the (real) samples.

    z: features of the model in ``slot``; z_glob: of ``ctx.payload[global_ref]``; z_prev: of the client's previous
    local model ``ctx.state[prev]`` (both detached).
    """

    mu: float
    tau: float = 0.5
    slot: str = "model"
    global_ref: str = "global"
    prev: str = "prev"

    def __call__(self, ctx: LocalContext) -> torch.Tensor:
        if self.mu == 0:
            return ctx.zero()
        z, _ = ctx.forward(self.slot)
        z_glob = ctx.teacher(ctx.payload[self.global_ref], "global")[0]
        z_prev = ctx.teacher(ctx.state[self.prev], "local")[0]
        sims = torch.stack([F.cosine_similarity(z, z_glob, dim=1), F.cosine_similarity(z, z_prev, dim=1)], 1)
        per_sample = -F.log_softmax(sims / self.tau, dim=1)[:, 0]
        return self.mu * ctx.mean(per_sample)
