"""FCCL (Huang et al., CVPR 2022): federated cross-correlation and continual learning. Rules from the authors'
code (github.com/WenkeHuang/FCCL, ``fccl/Idea/Ours/FCCL.py`` and ``fccl/Idea/utils_idea.py``).

Public phase: the cross-correlation matrix C = s_hat^T t_hat / B between the client's logits s and the target t, the
mean over the whole cohort of the round-start logits (the authors average the other clients' outputs with the
client's own model from the end of the previous round, recomputing the others' at every public batch — here they are
the round-start ones, the family's one exchange per round); each standardised over the batch with the unbiased
standard deviation (torch's ``.std(0)``, no eps); loss = sum_c (C_cc - 1)^2 + ``off`` * sum_{c != d} (C_cd + 1)^2.
Private phase (dual distillation): CE + tau^2 KL(inter || model) + tau^2 KL(intra || model) at temperature ``tau``
(the authors: T = 1, no T^2 factor — the same at the default), with the inter-domain teacher the client's model from
the end of its previous round (after its private training: the model it starts this round from) and the intra-domain
teacher the frozen model trained on the private data before any collaboration (``pre``: the warm-up result, so
``train.warmup_epochs`` must be at least 1). Both teachers run in eval mode, as the authors', with the client's
BatchNorm statistics from the start of the round (the warm-up's own are not kept: with BatchNorm the frozen teacher
differs there from the authors').
"""

import torch
from pydantic import Field

from ..protocol.algorithm import register_algorithm
from ..protocol.context import TaskLoss
from ..protocol.tree import clone
from .exchange import ExchangeConfig, LogitExchange, kl_rows


class FCCLConfig(ExchangeConfig):
    off: float = Field(0.0051, ge=0, le=1e3, description="weight of the off-diagonal terms")
    tau: float = Field(1.0, gt=0, le=100, description="distillation temperature (the KL terms are scaled by tau^2)")


def standardise(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each column z-scored over the real rows with the unbiased variance (the authors' ``(x - x.mean(0)) /
    x.std(0)``); padding rows are zero."""
    n = mask.sum()
    mean = (x * mask[:, None]).sum(0) / n.clamp(min=1)
    var = (((x - mean) ** 2) * mask[:, None]).sum(0) / (n - 1).clamp(min=1)
    # (a constant column: 0 / 1e-12 = 0 where the authors' code gives NaN; clamped on var so the gradient is finite)
    return (x - mean) / var.clamp(min=1e-24).sqrt() * mask[:, None]


def cross_correlation_loss(s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, off: float,
                           ctx=None) -> torch.Tensor:
    """sum_c (C_cc - 1)^2 + off * sum_{c != d} (C_cd + 1)^2, C = s_hat^T t_hat / B (B the real rows); with ``ctx``
    the two parts are recorded as terms."""
    c = standardise(s, mask).T @ standardise(t.detach(), mask) / mask.sum().clamp(min=1)
    eye = torch.eye(c.shape[0], dtype=c.dtype, device=c.device)
    on, rest = (((c - 1) ** 2) * eye).sum(), off * (((c + 1) ** 2) * (1 - eye)).sum()
    return on + rest if ctx is None else ctx.term("on_diag", on) + ctx.term("off_diag", rest)


@register_algorithm
class FCCL(LogitExchange):
    name = "fccl"
    Config = FCCLConfig
    needs_warmup = True  # without it the frozen "pre-trained" teacher would be a random model

    def init_client(self, init_params):
        return {"model": clone(init_params), "pre": clone(init_params)}

    def after_warmup(self, state):
        return {**state, "pre": clone(state["model"])}

    def exchange(self, server, logits, clients, round_idx):
        return {"target": logits.mean(0)}  # every client's target is the same cohort mean: only it goes down

    def collaborate(self, ctx):
        _, s = ctx.forward()
        return cross_correlation_loss(s, ctx.payload["target"][ctx.y], ctx.mask, self.cfg.off, ctx)

    def local_loss(self, ctx):
        tau = self.cfg.tau
        _, s = ctx.forward()
        # ctx.state["model"]: the model the client ended its previous round with (its state is written in finish)
        inter = ctx.teacher(ctx.state["model"], "local")[1]
        intra = ctx.teacher(ctx.state["pre"], "local")[1]
        return (ctx.term("task_loss", TaskLoss()(ctx))
                + ctx.term("inter_kl", tau * tau * ctx.mean(kl_rows(inter, s, tau)))
                + ctx.term("intra_kl", tau * tau * ctx.mean(kl_rows(intra, s, tau))))

    def finish(self, params, state, payload, stats):
        return {}, {**state, "model": params["model"]}
