"""Meta-learning personalization: Per-FedAvg (first-order MAML, Fallah et al. 2020) and FedMeta (MAML, Chen et al.
2018), plus FedAvg with fine-tuning. All three train a global model and personalize it right before evaluation with
a few local steps on the client's *train* data (the round program's fine-tuning phase: nothing uploaded, nothing
kept, never any test data).

Per-FedAvg (FO): each step takes two disjoint batches D, D' of the client's train split (2B samples of one shuffle,
cut in two as PFLlib's clientperavg does: an epoch is ceil(n / 2B) steps); w' = w − alpha ∇f(w; D) and the step
is w ← w − beta ∇f(w'; D') (first order: the inner gradient is treated as a constant), a plain gradient step as in
the paper, PFLlib's clientperavg and the pFedMe repository's userperavg (never the run's momentum, weight decay or
Adam state). Personal model: one alpha step on a train batch.

FedMeta (MAML): each client's train split is cut once into support (``support`` = 80%) and query (20%) parts; a step
takes a support batch S and a query batch Q and follows the full second-order MAML gradient of f(w − alpha ∇f(w; S);
Q) with the meta learning rate (``train.optimizer.lr``, 0.01 in the APFL paper) and the run's optimiser: the
meta-step is the method's training step, as FedAvg's is. Personal model: ``adapt_steps`` alpha steps on train
batches.

The alpha steps of both (inside the objective, and the personalization before evaluation) are plain gradient steps,
as MAML writes them. FedAvg + fine-tuning fine-tunes with the run's optimiser: those are ordinary local training
steps, as FedAvg's own.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field
from torch.func import grad

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import LocalContext
from ..protocol.program import Phase, Step, View


def _adapted(ctx: LocalContext, w: dict, alpha: float, first_order: bool) -> dict:
    """w − alpha ∇f(w) on the step's first batch (the inner gradient detached when first order)."""
    g = grad(lambda p: ctx.task_loss_of(p))(w)
    return {k: w[k] - alpha * (g[k].detach() if first_order else g[k]) for k in w}


def task_loss(ctx: LocalContext) -> torch.Tensor:
    return ctx.task_loss_of(ctx.params["model"])


class FineTuned(Algorithm):
    """A global model, personalized before evaluation by ``adapt_steps`` steps at ``adapt_lr`` on train batches."""

    personalized = True
    #: the fine-tuning steps are plain gradient steps (MAML's alpha steps), not the run's optimiser
    plain_adapt: ClassVar[bool] = False

    def adapt_lr(self) -> float | None:
        return None

    def finetune(self):
        step = Step(objective=task_loss, lr=self.adapt_lr(), plain=self.plain_adapt)
        return [Phase(steps=self.cfg.adapt_steps, updates=(step,))]


class MAML(FineTuned):
    """Steps on the task loss at the adapted point w − alpha ∇f(w) of the step's first batch, measured on its paired
    batch; personal model = alpha steps."""

    first_order: ClassVar[bool]
    plain_adapt = True

    def adapt_lr(self):
        return self.cfg.alpha

    def loss(self, ctx: LocalContext) -> torch.Tensor:
        x2, y2, m2 = ctx.pair
        return ctx.task_loss_of(_adapted(ctx, ctx.params["model"], self.cfg.alpha, self.first_order), x2, y2, m2)


class PerFedAvgConfig(AlgoConfig):
    alpha: float = Field(0.005, gt=0, description="inner (personalization) step size")
    beta: float | None = Field(0.001, gt=0, description="outer step size (None: train.optimizer.lr)")
    adapt_steps: int = Field(1, ge=1, le=10_000, description="alpha steps on train batches before evaluation")


@register_algorithm
class PerFedAvg(MAML):
    """Per-FedAvg (Fallah et al. 2020), first-order: plain steps at w − alpha ∇f(w; D) on a disjoint second batch
    D'; personal model = alpha steps on train batches."""

    name = "perfedavg"
    Config = PerFedAvgConfig
    first_order = True

    def program(self, round_idx):
        return [Phase(pair=View("next"), updates=(Step(lr=self.cfg.beta, plain=True),))]


class FedMetaConfig(AlgoConfig):
    alpha: float = Field(0.01, gt=0, description="inner step size on the support batch")
    support: float = Field(0.8, gt=0, lt=1, description="fraction of each client's train split in its support set")
    adapt_steps: int = Field(1, ge=1, le=10_000, description="alpha steps on train batches before evaluation")


@register_algorithm
class FedMeta(MAML):
    """FedMeta (Chen et al. 2018): second-order MAML on each client's support/query split of its train data;
    personal model = alpha steps on train batches."""

    name = "fedmeta"
    Config = FedMetaConfig
    first_order = False

    def program(self, round_idx):
        return [Phase(view=View("support", self.cfg.support), pair=View("query", self.cfg.support))]


class FedAvgFTConfig(AlgoConfig):
    adapt_steps: int = Field(10, ge=1, le=10_000, description="local SGD steps on train batches before evaluation")
    adapt_lr: float | None = Field(None, gt=0, description="their learning rate (None: the round's)")


@register_algorithm
class FedAvgFT(FineTuned):
    """FedAvg + fine-tuning: FedAvg, and each client's personal model is the global one after a few local SGD steps
    on its train data."""

    name = "fedavg_ft"
    Config = FedAvgFTConfig

    def adapt_lr(self):
        return self.cfg.adapt_lr
