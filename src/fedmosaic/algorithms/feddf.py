"""FedDF (Lin et al., NeurIPS 2020): ensemble distillation on the public stream, tau^2 KL(ensemble || student) at
temperature ``tau``. The ensemble (``teacher``): ``logits`` (default) the softmax of the cohort's averaged logits,
sigma(mean_k z_k / tau) — the paper's Algorithm 1 and the authors' runs
(github.com/epfml/federated-learning-public-code, ``codes/FedDF-code``: ``update_student_scheme=avg_logits`` in its
README, ``divergence`` in ``pcode/aggregation/adv_knowledge_transfer.py``); ``probs`` the mean of the softmaxes
(their ``avg_probs``). The authors' KL has no tau^2 factor; their runs use the default tau = 1 (the README's
commands set none), where the two are the same.

``feddf`` (heterogeneous mode): each client distils itself toward the ensemble of the cohort's round-start outputs
(its own included), then trains with CE on its private data — with one architecture per client and no global model,
each client distils itself, as the FCCL authors' heterogeneous FedDF baseline does (github.com/WenkeHuang/FCCL,
``fccl+/models/feddf.py``: softmax of the averaged logits too, recomputed at every public batch). ``feddf_global``
(the original, one shared architecture): clients train the global model with CE as in FedAvg; the server averages
their models and then distils the average toward the ensemble of the uploaded models (``public_epochs`` passes over
the stream with the clients' optimiser and learning rate — the authors: Adam 1e-3 with cosine decay over 10,000
batches of 128, gradient norm clipped at 5, early stopping on a validation split).
"""

from typing import Literal

import torch
from pydantic import Field

from ..protocol.algorithm import Algorithm, register_algorithm
from ..protocol.program import Phase, Step
from .exchange import PUBLIC, ExchangeConfig, LogitExchange


class FedDFConfig(ExchangeConfig):
    tau: float = Field(1.0, gt=0, le=100, description="distillation temperature")
    teacher: Literal["logits", "probs"] = Field("logits", description="the ensemble: softmax of the averaged logits "
                                                "(the authors') or the mean of the softmaxes")


@register_algorithm
class FedDF(LogitExchange):
    name = "feddf"
    Config = FedDFConfig

    def exchange(self, server, logits, clients, round_idx):
        return ensemble(logits, self.cfg.tau, self.cfg.teacher)

    def collaborate(self, ctx):
        return distill_to_ensemble(ctx, self.cfg.tau)


def ensemble(logits: torch.Tensor, tau: float, teacher: str) -> dict:
    """The ensemble's probabilities [N0, C] from the cohort's logits [n, N0, C]."""
    if teacher == "logits":
        return {"ensemble": torch.softmax(logits.mean(0) / tau, -1)}
    return {"ensemble": torch.softmax(logits / tau, -1).mean(0)}


def distill_to_ensemble(ctx, tau: float) -> torch.Tensor:
    """tau^2 KL(ensemble || softmax(student / tau)) over the public batch (the ensemble rows ``ctx.y``)."""
    _, s = ctx.forward()
    t = ctx.payload["ensemble"][ctx.y]
    kl = (t * (t.clamp(min=1e-12).log() - torch.log_softmax(s / tau, -1))).sum(-1)
    return tau * tau * ctx.mean(kl)


@register_algorithm
class FedDFGlobal(Algorithm):
    name = "feddf_global"
    Config = FedDFConfig  # public_epochs: the server's passes over the stream
    uses_public = True  # the server distils on it

    def exchange(self, server, logits, clients, round_idx):
        return ensemble(logits, self.cfg.tau, self.cfg.teacher)

    def server_program(self, server, round_idx):
        return [Phase(view=PUBLIC, epochs=self.cfg.public_epochs, batch=self.cfg.public_batch,
                      updates=(Step(("model",), self.distill),))]

    def distill(self, ctx):  # (a method, not a lambda: equal Steps share one cached mapped function)
        return distill_to_ensemble(ctx, self.cfg.tau)
