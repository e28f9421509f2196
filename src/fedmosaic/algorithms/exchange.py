"""What the model-heterogeneous family shares (AHF, FedMD, FedDF, RHFL, FCCL): clients keep models of their own
(any architecture), send their logits on the shared public stream at the start of a round, train on the public
stream against what the server sent back (``collaborate``), then on their private data (``local_loss``).

The round program: ``Phase(view=public, Step(model, collaborate), after=snapshot)`` then ``Phase(Step(model,
local_loss), key=0)`` (the private phase draws Local's batches). With ``snapshot`` the model as it stood after the
collaborative phase is kept for the round as slot ``snap`` (AHF's distillation teacher).

Per-sample helpers for the objectives, written for one client (vmapped): the public batch's sample indices are
``ctx.y`` (the stream has no labels), so a client reads the teachers' logits of its batch as ``logits[:, ctx.y]``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field

from ..protocol.algorithm import AlgoConfig
from ..protocol.context import LocalContext, TaskLoss
from ..protocol.program import Phase, Step, View
from ..protocol.tree import clone
from .local import Local

PUBLIC = View("public")


class ExchangeConfig(AlgoConfig):
    public_epochs: int = Field(1, ge=1, le=1000, description="passes over the public stream per round")
    public_batch: int | None = Field(None, ge=1, le=1_000_000, description="public batch (default: train.batch_size)")


def _snapshot(params, state, payload):
    return {**params, "snap": clone(params["model"])}, state


class LogitExchange(Local):
    exchanges = True
    uses_public = True
    Config: ClassVar = ExchangeConfig
    #: keep the model after the collaborative phase as slot ``snap`` for the private phase
    snapshot: ClassVar[bool] = False

    def local_init(self, payload, state):
        return {"model": state["model"], **({"snap": state["model"]} if self.snapshot else {})}

    def program(self, round_idx):
        return [Phase(view=PUBLIC, epochs=self.cfg.public_epochs, batch=self.cfg.public_batch,
                      updates=(Step(("model",), self.collaborate),), after=_snapshot if self.snapshot else None),
                Phase(updates=(Step(("model",), self.local_loss),), key=0)]

    def collaborate(self, ctx: LocalContext) -> torch.Tensor:
        raise NotImplementedError

    def local_loss(self, ctx: LocalContext) -> torch.Tensor:
        return TaskLoss()(ctx)


def kl_rows(teacher_logits: torch.Tensor, student_logits: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """KL(softmax(teacher / tau) || softmax(student / tau)) per row (over the last axis), the teacher detached."""
    log_t = F.log_softmax(teacher_logits.detach() / tau, -1)
    return (log_t.exp() * (log_t - F.log_softmax(student_logits / tau, -1))).sum(-1)


def masked_mean(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the last axis of the real samples (``mask``); leading axes (teachers) kept."""
    return (per_sample * mask).sum(-1) / mask.sum().clamp(min=1)


def others(ctx: LocalContext) -> torch.Tensor:
    """[n] 1.0 for every cohort client but this one (vmap-safe: no boolean indexing)."""
    return (ctx.payload["clients"] != ctx.payload["own"]["cid"]).to(ctx.payload["logits"].dtype)


def distill_to(slot: str, tau: float = 1.0):
    """The term tau^2 KL(softmax of the model in ``slot`` of the round's trees || the model's) on the private
    batch, averaged over its samples."""

    def term(ctx: LocalContext) -> torch.Tensor:
        _, s = ctx.forward()
        _, t = ctx.forward(slot)
        return tau * tau * ctx.mean(kl_rows(t, s, tau))

    return term
