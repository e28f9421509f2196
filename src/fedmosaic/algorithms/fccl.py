"""FCCL (Huang et al., CVPR 2022): federated cross-correlation and continual learning.

Public phase: the cross-correlation matrix C = s_hat^T t_hat / B between the client's logits and the mean of the
other clients' round-start logits, each standardised over the batch (BatchNorm without affine, eps 1e-5);
loss = sum_c (C_cc - 1)^2 + ``off`` * sum_{c != d} (C_cd + 1)^2. Private phase (dual distillation): CE + KL to the
model as it stood after the public phase (inter-domain knowledge) + KL to the frozen model trained on the private
data before collaboration (``pre``: the warm-up result, intra-domain knowledge), temperature ``tau``.
"""

import torch
from pydantic import Field

from ..engine.tree import clone
from .base import register_algorithm
from .exchange import ExchangeConfig, LogitExchange, distill_to, others
from .terms import TaskLoss


class FCCLConfig(ExchangeConfig):
    off: float = Field(0.0051, ge=0, le=1e3, description="weight of the off-diagonal terms")
    tau: float = Field(1.0, gt=0, le=100, description="distillation temperature")


def standardise(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Each column z-scored over the real rows (biased variance, as BatchNorm1d in training mode)."""
    n = mask.sum().clamp(min=1)
    mean = (x * mask[:, None]).sum(0) / n
    var = (((x - mean) ** 2) * mask[:, None]).sum(0) / n
    return (x - mean) / torch.sqrt(var + eps) * mask[:, None]


def cross_correlation_loss(s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, off: float) -> torch.Tensor:
    c = standardise(s, mask).T @ standardise(t.detach(), mask) / mask.sum().clamp(min=1)
    eye = torch.eye(c.shape[0], dtype=c.dtype, device=c.device)
    return (((c - 1) ** 2) * eye).sum() + off * (((c + 1) ** 2) * (1 - eye)).sum()


@register_algorithm
class FCCL(LogitExchange):
    name = "fccl"
    Config = FCCLConfig
    snapshot = True

    def init_client(self, server, init_params):
        return {"model": clone(init_params), "pre": clone(init_params)}

    def after_warmup(self, state):
        return {**state, "pre": clone(state["model"])}

    def collaborate(self, ctx):
        _, s = ctx.forward()
        other = others(ctx)
        t = (ctx.payload["logits"][:, ctx.y] * other[:, None, None]).sum(0) / other.sum().clamp(min=1)
        return cross_correlation_loss(s, t, ctx.mask, self.cfg.off)

    def local_loss(self, ctx):
        tau = self.cfg.tau
        return TaskLoss()(ctx) + distill_to("snap", tau)(ctx) + distill_to("pre", tau)(ctx)

    def finish(self, params, state, payload, stats):
        return {}, {**state, "model": params["model"]}
