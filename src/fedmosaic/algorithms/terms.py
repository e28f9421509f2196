"""Reusable pieces of local objectives. A term maps a :class:`LocalContext` to a scalar; objectives are sums of terms.

Write each term once, test it once, reuse it everywhere (FedProx = task loss + Prox; FedProto = task loss +
PrototypeMSE; later FedNTD = task loss + not-true distillation, and so on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..engine.tree import leaves


class LocalContext:
    """What a local objective sees for one client and one (padded) batch.

    ``params`` are the trainable trees by slot (e.g. ``{"model": ...}`` or Ditto's ``{"model", "personal"}``),
    ``state`` the client's persistent state, ``payload`` what the server broadcast. ``mask`` marks real samples in
    a padded batch; every per-sample quantity must be reduced with :meth:`mean`.
    """

    def __init__(self, apply, params, state, payload, x, y, mask, task_loss: str = "ce"):
        self.apply, self.params, self.state, self.payload = apply, params, state, payload
        self.x, self.y, self.mask = x, y, mask
        self.task_loss = task_loss
        self._out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, slot: str = "model") -> tuple[torch.Tensor, torch.Tensor]:
        """(features, logits) of the model in ``slot`` on this batch, computed once."""
        if slot not in self._out:
            self._out[slot] = self.apply(self.params[slot], self.x)
        return self._out[slot]

    def mean(self, per_sample: torch.Tensor) -> torch.Tensor:
        return (per_sample * self.mask).sum() / self.mask.sum().clamp(min=1)


def per_sample_task_loss(kind: str, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "ce":
        return F.cross_entropy(logits, y, reduction="none")
    if kind == "hinge":  # Crammer–Singer multiclass hinge; for two classes it is the usual SVM hinge
        true = logits.gather(1, y[:, None])
        margins = (1 + logits - true).clamp(min=0)
        return margins.scatter(1, y[:, None], 0.0).amax(1)
    raise ValueError(f"unknown task loss {kind!r}")


@dataclass(frozen=True)
class TaskLoss:
    """The supervised loss (cross-entropy, or hinge for the linear SVM) of the model in ``slot``."""

    slot: str = "model"

    def __call__(self, ctx: LocalContext) -> torch.Tensor:
        _, logits = ctx.forward(self.slot)
        return ctx.mean(per_sample_task_loss(ctx.task_loss, logits, ctx.y))


@dataclass(frozen=True)
class Prox:
    """(mu/2) ||w_slot - ref||^2 with ``ref`` a tree in the payload (FedProx, Ditto, pFedMe)."""

    mu: float
    slot: str = "model"
    ref: str = "global"

    def __call__(self, ctx: LocalContext) -> torch.Tensor:
        if self.mu == 0:
            return torch.zeros(())
        w, r = leaves(ctx.params[self.slot]), leaves(ctx.payload[self.ref])
        return 0.5 * self.mu * sum(((a - b) ** 2).sum() for a, b in zip(w, r, strict=True))


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
    slot: str = "model"

    def __call__(self, ctx: LocalContext) -> torch.Tensor:
        z, _ = ctx.forward(self.slot)
        target = ctx.payload["protos"][ctx.y]
        known = ctx.payload["has"][ctx.y]
        per_sample = ((z - target) ** 2).mean(1) * known
        return self.lam * ctx.mean(per_sample)
