"""Optimisers as pure functions ``update(params, grads, state, lr) -> (params, state)``, so they vmap over clients.

They follow ``torch.optim.SGD`` and ``torch.optim.Adam`` exactly (weight decay added to the gradient, PyTorch's
momentum buffer convention, bias-corrected Adam), which the tests check against torch.optim.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from .tree import tmap


class OptimizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    nesterov: bool = False
    weight_decay: float = Field(0.0, ge=0)
    lr_decay: float = Field(1.0, gt=0, le=1, description="lr of round t is lr * lr_decay**t")
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)

    def lr_at(self, round_idx: int) -> float:
        return self.lr * self.lr_decay**round_idx


def init_state(cfg: OptimizerConfig, params) -> dict:
    if cfg.name == "adam":
        return {"m": tmap(torch.zeros_like, params), "v": tmap(torch.zeros_like, params), "t": torch.zeros(())}
    if cfg.momentum > 0:
        # torch.optim.SGD seeds the buffer with the first gradient; the flag says whether that happened yet.
        return {"buf": tmap(torch.zeros_like, params), "started": torch.zeros(())}
    return {}


def update(cfg: OptimizerConfig, params, grads, state: dict, lr):
    wd = cfg.weight_decay
    if wd:
        grads = tmap(lambda g, p: g + wd * p, grads, params)
    if cfg.name == "adam":
        b1, b2 = cfg.betas
        t = state["t"] + 1
        m = tmap(lambda m_, g: b1 * m_ + (1 - b1) * g, state["m"], grads)
        v = tmap(lambda v_, g: b2 * v_ + (1 - b2) * g * g, state["v"], grads)
        c1, c2 = 1 - b1**t, 1 - b2**t
        new = tmap(lambda p, m_, v_: p - lr * (m_ / c1) / ((v_ / c2).sqrt() + cfg.eps), params, m, v)
        return new, {"m": m, "v": v, "t": t}
    if cfg.momentum > 0:
        mu, started = cfg.momentum, state["started"]
        buf = tmap(lambda b, g: torch.where(started > 0, mu * b + g, g), state["buf"], grads)
        direction = tmap(lambda b, g: g + mu * b, buf, grads) if cfg.nesterov else buf
        new = tmap(lambda p, d: p - lr * d, params, direction)
        return new, {"buf": buf, "started": torch.ones_like(started)}
    return tmap(lambda p, g: p - lr * g, params, grads), state
