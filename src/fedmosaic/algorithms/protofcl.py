"""ProtoFCL: federated class-incremental learning with prototypes, distillation and replay.

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
prototypes a client uploads are the class means over its task and memory samples at its final model of the round
(one pass after training).

Options (the paper's choice first): ``distance: euclidean | squared`` (in the softmaxes and L_R);
``lr_sum: true`` L_R as the paper's plain sum over classes (eq. 5), ``false`` its mean over the batch's samples;
``prototypes: global | local`` — ``local``: nothing is exchanged, every client keeps a library of its own (its class
means, a class keeping its prototype until the client meets it again), which L_C, L_D and prediction use. The
paper's ablations: without memory (no ``data.tasks.memory``), without L_D (``alpha: 0``), without L_R, "without
prototype learning" — no exchange at all (``beta: 0, prototypes: local``). Each round reports the teacher's entropy
over the classes it knew divided by its maximum ln N (``teacher_entropy``: 1 is a flat teacher with nothing to
distil; 0 while there is no teacher).
"""

from typing import Literal

import torch
from pydantic import Field

from ..errors import ConfigError
from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import LocalContext, onehot, only
from ..protocol.program import Probe
from ..protocol.tree import clone
from .continual import UNKNOWN, KeepsTeacher, soft_ce
from .fedproto import PrototypeServer
from .terms import class_sums


class ProtoFCLConfig(AlgoConfig):
    alpha: float = Field(1.0, ge=0, description="weight of the distillation from the previous task's model (L_D)")
    beta: float = Field(1.0, ge=0, description="weight of the prototype regulariser (L_R)")
    T: float = Field(2.0, gt=0, description="temperature of the distance softmax, in L_C and L_D")
    distance: Literal["euclidean", "squared"] = Field("euclidean", description="prototype distance (the paper's: "
                                                      "Euclidean; squared: its square)")
    lr_sum: bool = Field(True, description="L_R as the paper's sum over classes of the distances (false: their "
                                           "mean over the batch's samples)")
    prototypes: Literal["global", "local"] = Field("global", description="global: the server's library; local: "
                                                   "nothing exchanged, each client its own library")


def distances(z: torch.Tensor, protos: torch.Tensor, kind: str = "euclidean") -> torch.Tensor:
    """[B, C] Euclidean (or squared Euclidean) distances (the gradient at distance 0 kept finite)."""
    sq = ((z * z).sum(1, keepdim=True) + (protos * protos).sum(1) - 2 * z @ protos.T).clamp(min=1e-8)
    return sq.sqrt() if kind == "euclidean" else sq


def entropy_ratio(scores: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """[B] the entropy of softmax(``scores``) over the classes ``known`` divided by its maximum ln N (0 when N < 2)."""
    logp = only(scores, known).log_softmax(-1)
    h = -(torch.where(known > 0, logp.exp() * logp, 0.0)).sum(-1)
    n = known.sum()
    return h / torch.where(n > 1, n, 2.0).log() * (n > 1)


@register_algorithm
class ProtoFCL(KeepsTeacher, PrototypeServer, Algorithm):
    name = "protofcl"
    Config = ProtoFCLConfig
    needs_tasks = True
    global_model = False
    personalized = True
    shares_features = True
    memory_select = "nearest"

    def __init__(self, cfg=None, setting=None):
        super().__init__(cfg, setting)
        if self.local and len(self.setting.head_keys) != 2:
            raise ConfigError("protofcl: prototypes: local predicts through the model's head, which must be one "
                              f"linear layer (weight and bias); this model's head has {len(self.setting.head_keys)} "
                              "parameters")

    @property
    def local(self) -> bool:
        return self.cfg.prototypes == "local"

    def broadcast(self, server, round_idx):
        return {} if self.local else super().broadcast(server, round_idx)

    def aggregate(self, server, uploads, weights, round_idx, signals):
        if self.local:
            return server
        mean, count = self.senders_mean(uploads)  # (a class no one sent keeps its prototype)
        return {"protos": torch.where(count[:, None] > 0, mean, server["protos"]),
                "has": torch.maximum(server["has"], (count > 0).to(mean.dtype))}

    def init_client(self, init_params):
        dev = next(iter(init_params.values())).device
        protos = torch.zeros(self.num_classes, self.feature_dim, device=dev)  # the server's library's shape
        state = {**super().init_client(init_params), "model": clone(init_params), "teacher_protos": protos}
        if self.local:  # the client's own library
            state.update(protos=protos.clone(), has=torch.zeros(self.num_classes, device=dev))
        return state

    def library(self, payload, state) -> tuple[torch.Tensor, torch.Tensor]:
        """The prototypes [C, d] and which classes have one [C] that the client predicts with."""
        return (state["protos"], state["has"]) if self.local else (payload["protos"], payload["has"])

    def end_task(self, state, model, stats, seen, payload):
        # the teacher predicts with the library it had: its distances to today's prototypes (made by models that
        # have moved on) would be no prediction of it at all; over the classes that library holds (a class met by
        # clients none of whose prototypes reached the server has none: it would be a fake class at the origin)
        protos, has = self.library(payload, state)
        return {**super().end_task(state, model, stats, seen, payload), "teacher_protos": protos,
                "known": seen * has}

    def local_init(self, payload, state):
        return {"model": state["model"]}

    def loss(self, ctx: LocalContext) -> torch.Tensor:
        z, _ = ctx.forward()
        cfg = self.cfg
        glob, has = self.library(ctx.payload, ctx.state)
        hot = onehot(ctx.y, self.num_classes, ctx.mask)
        count = hot.sum(0)
        local = hot.T @ z / count.clamp(min=1)[:, None]  # [C, d] the batch's class means (differentiable)
        in_batch = (count > 0).to(z.dtype)
        protos = torch.where(has[:, None] > 0, glob, local.detach())
        known = torch.maximum(has, in_batch)
        logits = torch.where(known > 0, -distances(z, protos, cfg.distance) / cfg.T, UNKNOWN)
        loss = ctx.term("l_c", ctx.mean(-logits.log_softmax(-1).gather(1, ctx.y[:, None])[:, 0]))
        if cfg.alpha:
            old = ctx.state["known"]
            z_old = ctx.teacher(ctx.state["teacher"], "task")[0]
            teacher = -distances(z_old, ctx.state["teacher_protos"], cfg.distance)
            soft = soft_ce(teacher, -distances(z, protos, cfg.distance), old, cfg.T)
            loss = loss + cfg.alpha * ctx.term("l_d", ctx.mean(soft) * (old.sum() > 0))
            ctx.term("teacher_entropy", ctx.mean(entropy_ratio(teacher / cfg.T, old)))
        if cfg.beta:
            gap = ((local - glob) ** 2).sum(1).clamp(min=1e-8)
            gap = gap.sqrt() if cfg.distance == "euclidean" else gap
            l_r = (gap * in_batch * has).sum() if cfg.lr_sum else (gap * count * has).sum() / count.sum().clamp(min=1)
            loss = loss + cfg.beta * ctx.term("l_r", l_r)
        return loss

    def probes(self, round_idx, payload):
        return [Probe("protos", kind="sums", objective=self._class_sums)]

    def _class_sums(self, ctx):
        return class_sums(ctx, self.num_classes)

    def finish(self, params, state, payload, stats):
        count = stats["protos"]["count"]
        protos = stats["protos"]["sum"] / count.clamp(min=1)[:, None]
        sent = (count > 0).to(protos.dtype)
        if self.local:  # nothing sent; a class keeps its prototype until the client meets it again
            return {}, {**state, "model": params["model"], "has": torch.maximum(state["has"], sent),
                        "protos": torch.where(sent[:, None] > 0, protos, state["protos"])}
        return {"protos": protos, "has": sent}, {**state, "model": params["model"]}

    def personal_params(self, state, payload):
        if not self.local:
            return state["model"]
        # nearest of the client's own prototypes through the model's linear head: argmin ||z - p_k|| is
        # argmax 2 z.p_k - ||p_k||^2, so weight 2P and bias -||P||^2 (classes without one: never chosen)
        model, p, has = state["model"], state["protos"], state["has"]
        w, b = sorted(self.setting.head_keys, key=lambda k: -model[k].dim())  # the [C, d] weight, the [C] bias
        return {**model, w: 2 * p, b: torch.where(has > 0, -(p * p).sum(1), UNKNOWN)}

    def eval_logits(self, z, logits, payload):
        if self.local:
            return logits
        return torch.where(payload["has"] > 0, -distances(z, payload["protos"]), float("-inf"))
