"""FedSI — a RECONSTRUCTION, not the paper's rule: FedAvg whose clients keep synaptic intelligence (Zenke, Poole &
Ganguli, ICML 2017) on the shared model across tasks.

The paper ProtoFCL compares against (Zhang et al., "Communication-efficient federated continual learning for
distributed learning system with Non-IID data", Sci China Inf Sci 2023, 66: 122102) could not be read here (neither
its text nor code is reachable offline); ProtoFCL describes it only as "利用正则化约束缓解灾难性遗忘" (regularisation
against forgetting). This file builds what the name says: synaptic intelligence on the model the clients share.

Every client keeps, per parameter of the shared model, the path integral ω of the current task — the loss decrease
each parameter is responsible for, Σ −g_k Δθ_k along its local training paths (g the gradient of the unregularised
task loss) —, the importance Ω of the earlier tasks and the anchor θ* (the global model at the end of the previous
task). At the end of a task Ω ← Ω + max(ω, 0) / (Δ² + ξ), Δ = θ(end of task) − θ*, then ω ← 0 and θ* ← θ(end of task); the
local loss is L_task + c Σ_k Ω_k (θ_k − θ*_k)² (Zenke et al., eqs. 4-5: no 1/2). The server averages models as FedAvg.

How ω is measured (a deviation from SI's per-step sum, docs/design.md): per round, over the straight segment from the
model the client received to its final one, by the trapezoid rule with the full-data task-loss gradients at both
ends, ω += −½ (g(θ_received) + g(θ_final)) ⊙ (θ_final − θ_received) (two gradient passes per round: probes). On a
quadratic loss with a diagonal Hessian it equals SI's integral along any path exactly (the integral of each
coordinate is then path-independent); elsewhere it is its first-order estimate, without the minibatch noise that
biases SI's per-step sum upwards. The cross-entropy is over the current task's classes (``ce_classes: task``), as
the other regularisation baselines (FedEWC, FedLwF).
"""

import torch
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import CE_CLASSES, TaskLoss
from ..protocol.program import Probe
from ..protocol.tree import clone, leaves, tmap
from .terms import ce_classes_field


class FedSIConfig(AlgoConfig):
    c: float = Field(0.1, ge=0, description="strength of the surrogate loss (Zenke et al.'s c; their 0.1 for "
                     "permuted MNIST and CIFAR; 0 = FedAvg fine-tuning)")
    xi: float = Field(1e-3, gt=0, description="damping ξ of the importance's denominator (Zenke et al.: 1e-3)")
    ce_classes: CE_CLASSES = ce_classes_field()


@register_algorithm
class FedSI(Algorithm):
    name = "fedsi"
    Config = FedSIConfig
    needs_tasks = True

    def init_client(self, init_params):
        zeros = lambda: tmap(torch.zeros_like, init_params)  # noqa: E731
        return {"anchor": clone(init_params), "omega": zeros(), "importance": zeros()}

    def probes(self, round_idx, payload):
        task = TaskLoss(classes=self.cfg.ce_classes)  # SI integrates the gradient of the unregularised loss
        return [Probe("g_start", at="received", kind="grad", objective=task, slots=("model",)),
                Probe("g_end", at="final", kind="grad", objective=task, slots=("model",))]

    def loss(self, ctx):
        task = TaskLoss(classes=self.cfg.ce_classes)(ctx)
        if self.cfg.c == 0:
            return task
        w, a, imp = (leaves(t) for t in (ctx.params["model"], ctx.state["anchor"], ctx.state["importance"]))
        pen = self.cfg.c * sum((o * (wi - ai) ** 2).sum() for wi, ai, o in zip(w, a, imp, strict=True))
        return ctx.term("task_loss", task) + ctx.term("si", pen)

    def finish(self, params, state, payload, stats):
        w, w0 = params["model"], payload["global"]
        g0, g1 = stats["g_start"]["model"], stats["g_end"]["model"]
        omega = tmap(lambda o, a, b, x, x0: o - 0.5 * (a + b) * (x - x0), state["omega"], g0, g1, w, w0)
        return {"model": w}, {**state, "omega": omega}

    def end_task(self, state, model, stats, seen, payload):
        # (a negative path integral — the loss rose along a parameter's path, which the round-level segments allow
        # and SI's per-step lr * g^2 estimate never gives — would make the penalty concave, unbounded below: 0)
        imp = tmap(lambda o, om, x, a: o + om.clamp(min=0) / ((x - a) ** 2 + self.cfg.xi), state["importance"],
                   state["omega"], model, state["anchor"])
        return {"anchor": model, "omega": tmap(torch.zeros_like, state["omega"]), "importance": imp}
