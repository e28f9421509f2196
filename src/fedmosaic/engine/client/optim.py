"""Optimisers applied to the stacked parameters of a whole cohort at once, in place.

SGD and Adam are element-wise, so one update over the stacked trees is exactly one update per client; doing it in
place (``torch._foreach_*``) avoids allocating a fresh copy of every client's parameters at every step. They follow
``torch.optim.SGD`` and ``torch.optim.Adam`` (weight decay added to the gradient, PyTorch's momentum buffer seeded
with the first gradient, bias-corrected Adam); the tests check them against torch.optim. All clients of a cohort
start the round together, so the step index — and with it Adam's bias correction — is shared.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator

from ...schema import Schema, unused


class PlateauConfig(Schema):
    """The learning rate cut by ``factor`` when the cohort's mean training loss has not improved for ``patience``
    rounds (torch's ReduceLROnPlateau, relative threshold 1e-4), never below ``min_lr``; with task streams it
    starts again at each new task. The first ``skip`` rounds (of the run, or of each task) are not compared: a new
    task's first loss measures something else (ProtoFCL's new classes have no global prototype yet)."""

    patience: int = Field(3, ge=0, le=10**6)
    skip: int = Field(1, ge=0, le=10**6)
    factor: float = Field(0.1, gt=0, lt=1)
    min_lr: float = Field(1e-4, ge=0)


class OptimizerConfig(Schema):
    name: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    nesterov: bool = False
    weight_decay: float = Field(0.0, ge=0)
    lr_decay: float = Field(1.0, gt=0, le=1, description="lr of round t is lr * lr_decay**t")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam's decay rates, each in [0, 1)")
    eps: float = Field(1e-8, gt=0)
    plateau: PlateauConfig | None = Field(None, description="reduce the learning rate on loss plateaus")

    @field_validator("betas", mode="before")
    @classmethod
    def _pair(cls, v):
        return tuple(v) if isinstance(v, list) else v  # YAML has lists, not tuples

    @field_validator("betas")
    @classmethod
    def _betas(cls, v):
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"each must be in [0, 1) (got {list(v)})")
        return v

    @model_validator(mode="after")
    def _nesterov(self):
        if self.nesterov and (self.name != "sgd" or self.momentum == 0):
            raise ValueError("nesterov: needs name 'sgd' and momentum > 0")
        unused(self, "name", {"sgd": {"momentum", "nesterov"}, "adam": {"betas", "eps"}},
               {"lr", "weight_decay", "lr_decay", "plateau"})
        return self

    def lr_at(self, round_idx: int) -> float:
        return self.lr * self.lr_decay**round_idx


#: A plain gradient step (``Step.plain``): no momentum, no weight decay.
PLAIN = OptimizerConfig()


def init_state(cfg: OptimizerConfig, params: list) -> dict:
    """Fresh state for a round (momentum restarts every round, as in FedNTD's setting)."""
    zeros = lambda: [torch.zeros_like(p) for p in params]  # noqa: E731
    if cfg.name == "adam":
        return {"m": zeros(), "v": zeros()}
    if cfg.momentum > 0:
        return {"buf": zeros()}
    return {}


def update_(cfg: OptimizerConfig, params: list, grads: list, state: dict, lr, step) -> None:
    """One step, in place on the leaf lists ``params`` and ``state``; ``step`` counts from 0 within the round.

    ``lr`` and ``step`` may be 0-d tensors, so that a compiled multi-step function neither branches on them nor
    recompiles when they change. Gradients come from torch.func and carry no graph: no ``no_grad`` needed.
    """
    ps, gs = params, grads
    if cfg.weight_decay:
        gs = torch._foreach_add(gs, ps, alpha=cfg.weight_decay)
    if cfg.name == "adam":
        b1, b2 = cfg.betas
        m, v = state["m"], state["v"]
        torch._foreach_lerp_(m, gs, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, gs, gs, value=1 - b2)
        c1, c2 = 1 - b1 ** (step + 1), 1 - b2 ** (step + 1)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, c2**0.5)
        torch._foreach_add_(denom, cfg.eps)
        upd = torch._foreach_div(m, denom)
        torch._foreach_mul_(upd, -lr / c1)
        torch._foreach_add_(ps, upd)
        return
    if cfg.momentum > 0:
        buf = state["buf"]
        # buf = mu * buf + g, seeded with g at the first step (torch.optim.SGD); no branch on ``step``
        torch._foreach_mul_(buf, cfg.momentum * (step > 0))
        torch._foreach_add_(buf, gs)
        gs = torch._foreach_add(gs, buf, alpha=cfg.momentum) if cfg.nesterov else buf
    if isinstance(lr, torch.Tensor):
        torch._foreach_add_(ps, torch._foreach_mul(gs, -lr))
    else:
        torch._foreach_add_(ps, gs, alpha=-lr)
