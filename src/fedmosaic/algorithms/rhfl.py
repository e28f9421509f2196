"""RHFL (Fang & Ye, CVPR 2022): robust heterogeneous FL.

Private phase: symmetric cross-entropy ``alpha`` CE + ``beta`` RCE, RCE = -sum_c p_c log q_c with q the one-hot
label clipped to [1e-4, 1] (= -log(1e-4) (1 - p_y)). Public phase: client i minimises sum_{j != i} w_j KL(p_j || p_i)
over the cohort's round-start outputs, w = softmax over the other clients of their confidence: the relative drop of
each client's private loss between its last two rounds (measured at its final model on one pass over its data),
kept by the server.
"""

import math

import torch
import torch.nn.functional as F
from pydantic import Field

from ..engine.program import Probe
from .base import register_algorithm
from .exchange import ExchangeConfig, LogitExchange, kl_rows, masked_mean, others
from .terms import per_sample_task_loss


class RHFLConfig(ExchangeConfig):
    alpha: float = Field(0.1, ge=0, le=1e3, description="weight of CE in the symmetric cross-entropy")
    beta: float = Field(1.0, ge=0, le=1e3, description="weight of reverse CE")


def sce(logits: torch.Tensor, y: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """Per-sample symmetric cross-entropy alpha CE + beta RCE (one-hot clipped at 1e-4)."""
    p_y = torch.softmax(logits, -1).gather(-1, y[..., None])[..., 0]
    return alpha * per_sample_task_loss("ce", logits, y) + beta * -math.log(1e-4) * (1 - p_y)


@register_algorithm
class RHFL(LogitExchange):
    name = "rhfl"
    Config = RHFLConfig

    def init_server(self, init_params):
        dev = next(iter(init_params[0].values())).device
        return {"last": torch.zeros(self.num_clients, device=dev), "conf": torch.zeros(self.num_clients, device=dev)}

    def exchange(self, server, logits, clients, round_idx):
        return {"logits": logits, "clients": clients, "conf": server["conf"][clients]}

    def collaborate(self, ctx):
        _, s = ctx.forward()
        other = others(ctx)
        w = torch.softmax(ctx.payload["conf"] + torch.log(other.clamp(min=1e-30)), 0) * other
        return (w * masked_mean(kl_rows(ctx.payload["logits"][:, ctx.y], s[None]), ctx.mask)).sum()

    def local_loss(self, ctx):
        _, s = ctx.forward()
        return ctx.mean(sce(s, ctx.y, self.cfg.alpha, self.cfg.beta))

    def probes(self, server, round_idx):
        return [Probe("loss", kind="sums", objective=self._private_loss)]

    def _private_loss(self, ctx):
        _, s = ctx.forward()
        return {"sum": (F.cross_entropy(s, ctx.y, reduction="none") * ctx.mask).sum(), "n": ctx.mask.sum()}

    def finish(self, params, state, payload, stats):
        loss = stats["loss"]["sum"] / stats["loss"]["n"].clamp(min=1)
        return {"loss": loss}, {"model": params["model"]}

    def aggregate(self, server, uploads, weights, round_idx, signals):
        ids, new = signals.clients, uploads["loss"]
        old = server["last"][ids]
        drop = torch.where(old > 0, (old - new) / old.clamp(min=1e-12), torch.zeros_like(new))
        return {"last": server["last"].index_put((ids,), new), "conf": server["conf"].index_put((ids,), drop)}
