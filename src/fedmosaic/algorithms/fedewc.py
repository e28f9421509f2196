"""FedEWC: FedAvg with elastic weight consolidation across tasks (Kirkpatrick et al.; online EWC, Schwarz et al.).

At the end of every task each client measures the diagonal Fisher of the task loss over its task's samples at the
global model (mean squared minibatch gradient, one pass: ``task_probes``), folds it into its running importance
F <- gamma F + F_task and anchors at that model; its local loss then adds (lam / 2) sum F (w - anchor)^2.

The cross-entropy it trains with is over the current task's classes (``ce_classes: task``), the one it measures the
Fisher with over every class met so far — both as PyCIL's class-incremental EWC (models/ewc.py:
``cross_entropy(logits[:, known:], targets - known)`` in training, the whole grown head in ``getFisherDiagonal``)."""

import torch
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import CE_CLASSES, TaskLoss
from ..protocol.program import Probe
from ..protocol.tree import clone, leaves, tmap
from .terms import ce_classes_field


class FedEWCConfig(AlgoConfig):
    lam: float = Field(10.0, ge=0, description="weight of the penalty; SGD stays stable while lam * max F * lr < 2 "
                       "(the FedAvg CNN's head reached F = 1.4 after one CIFAR-100 task: lam = 1000 diverged)")
    gamma: float = Field(1.0, ge=0, le=1, description="decay of the earlier tasks' importance (online EWC)")
    fisher_max: float | None = Field(None, gt=0, description="clip every Fisher entry at this value (PyCIL: 1e-4, "
                                     "which keeps its lam = 1000 stable); null: no clip")
    ce_classes: CE_CLASSES = ce_classes_field()


@register_algorithm
class FedEWC(Algorithm):
    name = "fedewc"
    Config = FedEWCConfig
    needs_tasks = True

    def init_client(self, init_params):
        return {"anchor": clone(init_params), "fisher": tmap(torch.zeros_like, init_params)}

    def task_probes(self):
        return [Probe("fisher", kind="grad_sq", slots=("model",), objective=TaskLoss(classes="seen"))]

    def end_task(self, state, model, stats, seen, payload):
        new = stats["fisher"]["model"]
        if self.cfg.fisher_max is not None:  # PyCIL's getFisherDiagonal: min(F, fisher_max)
            new = tmap(lambda t: t.clamp(max=self.cfg.fisher_max), new)
        fisher = tmap(lambda f, n: self.cfg.gamma * f + n, state["fisher"], new)
        return {"anchor": model, "fisher": fisher}

    def loss(self, ctx):
        task = TaskLoss(classes=self.cfg.ce_classes)(ctx)
        if self.cfg.lam == 0:
            return task
        w, a, f = (leaves(t) for t in (ctx.params["model"], ctx.state["anchor"], ctx.state["fisher"]))
        pen = 0.5 * self.cfg.lam * sum((fi * (wi - ai) ** 2).sum() for wi, ai, fi in zip(w, a, f, strict=True))
        return ctx.term("task_loss", task) + ctx.term("ewc", pen)
