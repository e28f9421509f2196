"""ProtoFCL (paper 003, METHODS.md §6): federated class-incremental learning with prototypes, distillation and replay.

Clients never share weights, only class prototypes (the mean feature of each class, eq. 2); the server keeps a
growing library of global prototypes, each the unweighted mean over the clients that sent that class (eq. 4), a
class keeping its prototype in rounds nobody sends it. Prediction: the nearest global prototype (Euclidean).
Local loss L = L_C + alpha L_D + beta L_R:

- L_C: cross-entropy of the distance softmax p(k|x) = softmax_k(-||f(x) - p_k|| / T) over every known class —
  the library's (detached), plus the batch's own classes the library lacks yet (their batch mean, detached);
- L_D: cross-entropy between the previous task's model's distance softmax (the teacher, kept at the end of each
  task with the prototype library it predicted with) and the current one's, at temperature T, over the classes the
  teacher knew (none in the first task);
- L_R: the sum over the batch's classes with a global prototype of the distance between the batch's (differentiable)
  local prototype and the global one.

Replay is the engine's exemplar memory (``data.tasks.memory``: per class or in total), filled with the samples
nearest to each class prototype; the learning rate falls on loss plateaus with ``train.optimizer.plateau``. The
paper's ablations: without memory (no ``data.tasks.memory``), without L_D (``alpha: 0``), without L_R
(``beta: 0``). The prototypes a client uploads are the class means over its task and memory samples at its final
model of the round (one pass after training).
"""

import torch
from pydantic import Field

from ..engine.program import Probe
from ..engine.tree import clone
from .base import AlgoConfig, Algorithm, register_algorithm
from .continual import UNKNOWN, KeepsTeacher, soft_ce
from .fedproto import PrototypeServer
from .terms import LocalContext, class_sums, onehot


class ProtoFCLConfig(AlgoConfig):
    alpha: float = Field(1.0, ge=0, description="weight of the distillation from the previous task's model (L_D)")
    beta: float = Field(1.0, ge=0, description="weight of the prototype regulariser (L_R)")
    T: float = Field(2.0, gt=0, description="temperature of the distance softmax, in L_C and L_D")


def distances(z: torch.Tensor, protos: torch.Tensor) -> torch.Tensor:
    """[B, C] Euclidean distances (the gradient at distance 0 kept finite)."""
    sq = (z * z).sum(1, keepdim=True) + (protos * protos).sum(1) - 2 * z @ protos.T
    return sq.clamp(min=1e-8).sqrt()


@register_algorithm
class ProtoFCL(KeepsTeacher, PrototypeServer, Algorithm):
    name = "protofcl"
    Config = ProtoFCLConfig
    global_model = False
    personalized = True
    shares_features = True
    memory_select = "nearest"

    def aggregate(self, server, uploads, weights, round_idx, signals):
        mean, count = self.senders_mean(uploads)  # (a class no one sent keeps its prototype)
        return {"protos": torch.where(count[:, None] > 0, mean, server["protos"]),
                "has": torch.maximum(server["has"], (count > 0).to(mean.dtype))}

    def init_client(self, server, init_params):
        return {**super().init_client(server, init_params), "model": clone(init_params),
                "teacher_protos": torch.zeros_like(server["protos"])}

    def end_task(self, state, model, stats, seen, payload):
        # the teacher predicts with the library it had: its distances to today's prototypes (made by models that
        # have moved on) would be no prediction of it at all; over the classes that library holds (a class met by
        # clients none of whose prototypes reached the server has none: it would be a fake class at the origin)
        return {**super().end_task(state, model, stats, seen, payload), "teacher_protos": payload["protos"],
                "known": seen * payload["has"]}

    def local_init(self, payload, state):
        return {"model": state["model"]}

    def loss(self, ctx: LocalContext) -> torch.Tensor:
        z, _ = ctx.forward()
        cfg, has, glob = self.cfg, ctx.payload["has"], ctx.payload["protos"]
        hot = onehot(ctx.y, self.num_classes, ctx.mask)
        count = hot.sum(0)
        local = hot.T @ z / count.clamp(min=1)[:, None]  # [C, d] the batch's class means (differentiable)
        in_batch = (count > 0).to(z.dtype)
        protos = torch.where(has[:, None] > 0, glob, local.detach())
        known = torch.maximum(has, in_batch)
        logits = torch.where(known > 0, -distances(z, protos) / cfg.T, UNKNOWN)
        loss = ctx.mean(-logits.log_softmax(-1).gather(1, ctx.y[:, None])[:, 0])
        if cfg.alpha:
            old = ctx.state["known"]
            z_old = ctx.apply(ctx.state["teacher"], ctx.x)[0].detach()
            soft = soft_ce(-distances(z_old, ctx.state["teacher_protos"]), -distances(z, protos), old, cfg.T)
            loss = loss + cfg.alpha * ctx.mean(soft) * (old.sum() > 0)
        if cfg.beta:
            gap = ((local - glob) ** 2).sum(1).clamp(min=1e-8).sqrt()
            loss = loss + cfg.beta * (gap * count * has).sum() / count.sum().clamp(min=1)
        return loss

    def probes(self, server, round_idx):
        return [Probe("protos", kind="sums", objective=self._class_sums)]

    def _class_sums(self, ctx):
        return class_sums(ctx, self.num_classes)

    def finish(self, params, state, payload, stats):
        count = stats["protos"]["count"]
        protos = stats["protos"]["sum"] / count.clamp(min=1)[:, None]
        return {"protos": protos, "has": (count > 0).to(protos.dtype)}, {**state, "model": params["model"]}

    def personal_params(self, state, server, own):
        return state["model"]

    def eval_logits(self, z, logits, server):
        return torch.where(server["has"] > 0, -distances(z, server["protos"]), float("-inf"))
