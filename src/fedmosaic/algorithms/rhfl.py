"""RHFL (Fang & Ye, CVPR 2022): robust heterogeneous FL. Rules from the authors' code
(github.com/FangXiuwen/Robust_FL, ``RHFL/HHF/HHF.py`` and ``RHFL/loss.py``).

Private phase: symmetric cross-entropy ``alpha`` CE + ``beta`` RCE, RCE = -sum_c p_c log q_c with p clipped to
[1e-7, 1] and q the one-hot label clipped to [1e-4, 1] (= -log(1e-4) sum_{c != y} max(p_c, 1e-7)).
Public phase: client i minimises sum_{j != i} w_j KL(p_j || p_i) over the cohort's round-start outputs (the authors
recompute the others' outputs at every public batch; here one exchange per round, as in the whole family).
Client confidence (CCR): q_j = (L_last - L_cur) / L_cur, L the client's mean symmetric-CE loss on its private data
at the model it started its last round from (L_last) and the one it ended it with (L_cur) — in the authors' loop the
losses measured at the starts of two consecutive rounds, i.e. at the same two models — then a_j = 1/(n-1) +
``ccr_beta`` q_j / sum_k q_k and w = softmax(a) over the whole cohort (the client's own entry included, so its
peers' weights sum to 1 - w_i). Guard (not in the authors' code): where sum_k q_k <= ``min_total_drop`` (the
cohort's losses did not fall: the ratio then flips sign and ranks first the clients whose loss rose, or divides by a
number near 0) every weight is 1/(n-1), the authors' weights of round 0 — which is also what round 0 gets here (no q
yet).
"""

import math

import torch
from pydantic import Field

from ..protocol.algorithm import register_algorithm
from ..protocol.context import onehot, per_sample_task_loss
from ..protocol.program import Probe
from .exchange import ExchangeConfig, LogitExchange, kl_rows, masked_mean, others


class RHFLConfig(ExchangeConfig):
    alpha: float = Field(0.1, ge=0, le=1e3, description="weight of CE in the symmetric cross-entropy")
    beta: float = Field(1.0, ge=0, le=1e3, description="weight of reverse CE")
    ccr_beta: float = Field(0.5, ge=0, le=1e3, description="beta of the client-confidence re-weighting (0: uniform "
                            "softmax weights)")
    min_total_drop: float = Field(1e-6, ge=0, le=1e3, description="guard: uniform weights 1/(n-1) when the "
                                  "cohort's relative loss drops sum to no more than this")


def sce_parts(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample (CE, RCE) of the symmetric cross-entropy, RCE with the authors' clipping."""
    p = torch.softmax(logits, -1).clamp(min=1e-7)
    rce = -math.log(1e-4) * (p * (1 - onehot(y, p.shape[-1]).to(p.dtype))).sum(-1)
    return per_sample_task_loss("ce", logits, y), rce


def confidence_weights(q: torch.Tensor, ccr_beta: float, min_total_drop: float) -> torch.Tensor:
    """[n] the CCR weights of a cohort from its clients' relative loss drops ``q`` [n] (module docstring)."""
    n, total = len(q), float(q.sum())
    if total <= min_total_drop:
        return torch.full_like(q, 1 / max(n - 1, 1))
    return torch.softmax(1 / max(n - 1, 1) + ccr_beta * q / total, 0)


@register_algorithm
class RHFL(LogitExchange):
    name = "rhfl"
    Config = RHFLConfig

    def init_server(self, init_params):
        dev = next(iter(init_params[0].values())).device
        return {"q": torch.zeros(self.num_clients, device=dev)}

    def exchange(self, server, logits, clients, round_idx):
        w = confidence_weights(server["q"][clients], self.cfg.ccr_beta, self.cfg.min_total_drop)
        return {"logits": logits, "clients": clients, "w": w}

    def collaborate(self, ctx):
        _, s = ctx.forward()
        w = ctx.payload["w"] * others(ctx)
        return (w * masked_mean(kl_rows(ctx.payload["logits"][:, ctx.y], s[None]), ctx.mask)).sum()

    def local_loss(self, ctx):
        _, s = ctx.forward()
        ce, rce = sce_parts(s, ctx.y)
        return ctx.term("ce", self.cfg.alpha * ctx.mean(ce)) + ctx.term("rce", self.cfg.beta * ctx.mean(rce))

    def probes(self, round_idx, payload):
        return [Probe("loss", kind="sums", objective=self._losses)]

    def _losses(self, ctx):
        """Summed symmetric-CE losses of the round-start model (the client's state) and the final one."""
        c = self.cfg

        def total(logits):
            ce, rce = sce_parts(logits, ctx.y)
            return ((c.alpha * ce + c.beta * rce) * ctx.mask).sum()

        return {"start": total(ctx.apply(ctx.state["model"], ctx.x)[1]), "end": total(ctx.forward()[1])}

    def finish(self, params, state, payload, stats):
        start, end = stats["loss"]["start"], stats["loss"]["end"]
        return {"q": (start - end) / end.clamp(min=1e-12)}, {"model": params["model"]}  # (sums: n cancels)

    def aggregate(self, server, uploads, weights, round_idx, signals):
        return {"q": server["q"].index_put((signals.clients,), uploads["q"])}
