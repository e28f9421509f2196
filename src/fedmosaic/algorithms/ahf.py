"""AHF: model-heterogeneous clients that learn from each other through logits on
random noise.

Round t, client k: every cohort client's logits z_i on the public stream X0 at the models they start the round
from come down. Collaborative phase on X0, student = the client's current model:
    L_col(k) = sum_{i != k} 1/(K-1) * PD_ki * mean_j( KL(p_i^j || p_k^j) * SD_k^j )
PD_ki: the mean over X0 of cos(z_k^j, z_i^j), clipped at 0 (``pd: similarity``; ``dissimilarity``: 1 - the mean) —
the paper sums over samples, the mean keeps the weight scale-free (METHODS.md's decision); a negative weight would
make the client maximise an unbounded KL (measured: the loss ran to -24 in three rounds), hence the clip. SD_k^j = 2 (1 - (V_k^j - min V_k) /
(max V_k - min V_k)), V_k^j the variance over classes of z_k^j: confident (peaked) samples weigh less.
``use_pd``/``use_sd`` false replace them by 1 (the paper's ablations; both false: the mean of pairwise KLs).
Then the private phase: CE + ``lam`` * KL(model after the collaborative phase || model), E epochs.
"""

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from ..protocol.algorithm import register_algorithm
from ..protocol.context import TaskLoss
from .exchange import ExchangeConfig, LogitExchange, distill_to, kl_rows, masked_mean, others


class AHFConfig(ExchangeConfig):
    pd: Literal["similarity", "dissimilarity"] = Field("similarity", description="PD weight: cosine similarity of "
                                                       "the logits (formula 2), or 1 - it")
    use_pd: bool = True
    use_sd: bool = True
    lam: float = Field(1.0, ge=0, le=1e6, description="weight of the KL to the post-collaboration model")


def pd_weights(z_own: torch.Tensor, z_all: torch.Tensor, kind: str) -> torch.Tensor:
    """[n]: mean over samples of cos(z_own^j, z_i^j) for each client i (``dissimilarity``: 1 - that)."""
    cos = F.cosine_similarity(z_own[None], z_all, dim=-1).mean(-1)
    # a negative weight would turn distillation into maximising a KL, which has no bound: similarity >= 0
    return 1 - cos if kind == "dissimilarity" else cos.clamp(min=0)


def sd_weights(z_own: torch.Tensor) -> torch.Tensor:
    """[N0]: 2 (1 - (V^j - min V) / (max V - min V)), V^j the variance of z_own^j over classes."""
    v = z_own.var(-1, unbiased=False)
    return 2 * (1 - (v - v.min()) / (v.max() - v.min()).clamp(min=1e-12))


def ahf_loss(student: torch.Tensor, z_all: torch.Tensor, idx: torch.Tensor, mask: torch.Tensor,
             other: torch.Tensor, own: torch.Tensor, pd: str = "similarity", use_pd: bool = True,
             use_sd: bool = True) -> torch.Tensor:
    """L_col of one client: ``student`` [B, C] its logits on the public batch ``idx`` [B] (real rows: ``mask``),
    ``z_all`` [n, N0, C] the cohort's round-start logits, ``other`` [n] 1 for the other clients, ``own`` [n] 1 for
    this one."""
    z_own = (z_all * own[:, None, None]).sum(0)
    w = pd_weights(z_own, z_all, pd) if use_pd else torch.ones_like(other)
    kl = kl_rows(z_all[:, idx], student[None])  # [n, B]
    if use_sd:
        kl = kl * sd_weights(z_own)[idx]
    return (other * w * masked_mean(kl, mask)).sum() / other.sum().clamp(min=1)


@register_algorithm
class AHF(LogitExchange):
    name = "ahf"
    Config = AHFConfig
    snapshot = True

    def collaborate(self, ctx):
        _, s = ctx.forward()
        other = others(ctx)
        c = self.cfg
        return ahf_loss(s, ctx.payload["logits"], ctx.y, ctx.mask, other, 1 - other, c.pd, c.use_pd, c.use_sd)

    def local_loss(self, ctx):
        return TaskLoss()(ctx) + self.cfg.lam * distill_to("snap")(ctx)
