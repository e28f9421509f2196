"""ProtoFCL: federated class-incremental learning with prototypes, distillation and replay (Zhang et al. 2024).

Clients never share weights, only class prototypes (the mean feature of each class, eq. 2). As the paper writes it
(``prototypes: paper``, the default), every client classifies with its OWN prototypes p_i: in L_C (eqs. 11-12), in
L_D's soft labels (eq. 8), in prediction (the nearest own prototype, Euclidean: eq. 3) and in exemplar selection
(eq. 9). The server keeps a growing library of global prototypes p̄_i, each the unweighted mean over the clients
that sent that class (eq. 4), a class keeping its prototype in rounds nobody sends it; the global prototypes enter
a client's training only through L_R = Σ_i dis(p_i, p̄_i) (eq. 5) — so without L_R (``beta: 0``) nothing is
exchanged at all ("Ours w/o L_R": no knowledge exchange between clients, §5.3).
Local loss L = L_C + alpha L_D + beta L_R:

- L_C: cross-entropy of the distance softmax p(k|x) = softmax_k(-d(f(x), p_k) / T) over every class the client
  knows — its own prototypes from the end of its previous round (detached), plus the batch's own classes it has
  none of yet (``new_classes``: their batch mean, detached — which moves with the features, so it caps no logit
  margin and can let a new task's features run away — or their mean over the client's data at the round's
  start, fixed for the round);
- L_D: cross-entropy between the previous task's model's distance softmax (the teacher, kept at the end of each
  task with the prototypes it predicted with) and the current one's, at temperature T, over the classes the
  teacher knew (none in the first task);
- L_R: over the batch's classes that have a global prototype, the distance between the batch's (differentiable)
  class mean and the global prototype: the paper's sum over classes (``lr_sum: true``) or the count-weighted mean
  over the batch's samples (``false``).

Replay is the engine's exemplar memory (``data.tasks.memory``: per class or in total), filled with the samples
nearest to the client's own class prototype; the learning rate falls on loss plateaus with
``train.optimizer.plateau``. The prototypes a client keeps (and uploads) are the class means over its task and memory
samples at its final model of the round (one pass after training); a class keeps its prototype until the client
meets it again.

Unstated by the paper, and chosen on validation splits (docs/results.md): beta, T and the form of L_R. Summed
Euclidean distances between the un-normalised features of models that share no weights are minimised fastest by
shrinking every client's feature space, and at beta = 1 the prototypes collapse (the distance softmax goes flat);
every evaluation therefore reports the prototype geometry (``report``): ``proto_inter`` the mean distance between two
classes' prototypes of one client, ``proto_spread`` the mean distance of a client's prototype of a class to the
clients' mean prototype of it, and their ratio ``proto_spread_ratio`` (<< 1: the clients agree on where a class
lies; ~1: two clients' prototypes of one class lie as far apart as two classes). Each round reports the teacher's
entropy over the classes it knew divided by its maximum ln N (``teacher_entropy``: 1 is a flat teacher with
nothing to distil; 0 while there is no teacher).

Other readings, as options: ``prototypes: global`` — the server's library classifies (L_C, L_D, prediction) and L_R
pulls to it (an earlier reading of the paper, fedmosaic's default before); ``prototypes: local`` — nothing is
exchanged and L_R pulls the batch's means to the client's own prototypes. ``distance: euclidean | squared`` (in the
softmaxes and L_R), or ``cosine``, a scale-free distance that is not the paper's: features are L2-normalised before
the class means (prototypes are means of unit features) and every distance is the Euclidean one between unit
vectors, ||f/|f| - p/|p||| = sqrt(2 - 2 cos) — so neither L_C nor L_D can be lowered by growing the features (the
un-normalised distance softmax rewards scale: on CIFAR-100's CNN the prototypes grew until the loss was not finite,
docs/results.md) and L_R cannot be lowered by shrinking them. Distances lie in [0, 2]: T must be small (0.02 on
CIFAR-100's CNN, chosen on validation). Prediction stays the nearest own prototype (argmax of f.p/|p|); exemplar
selection stays the nearest to the class mean of the raw features. The paper's ablations: without memory (no
``data.tasks.memory``), without L_D (``alpha: 0``), without L_R (``beta: 0``: nothing exchanged).
"""

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from ..errors import ConfigError
from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import LocalContext, onehot, only
from ..protocol.program import RECEIVED, Probe
from ..protocol.tree import clone
from .continual import UNKNOWN, KeepsTeacher, soft_ce
from .fedproto import PrototypeServer
from .terms import class_sums, linear_head


class ProtoFCLConfig(AlgoConfig):
    alpha: float = Field(1.0, ge=0, description="weight of the distillation from the previous task's model (L_D); "
                         "the paper gives none: on validation splits 1 on CIFAR-100, 3 on Split-MNIST")
    beta: float = Field(0.1, ge=0, description="weight of the prototype regulariser (L_R); the paper gives none: "
                        "0.1 was best on validation splits (docs/results.md), 1 collapses the features")
    T: float = Field(2.0, gt=0, description="temperature of the distance softmax, in L_C and L_D (the paper's "
                     "sweep: 2; on validation splits here 0.5 on Split-MNIST, 0.02 with distance: cosine on "
                     "CIFAR-100, which the image presets use)")
    distance: Literal["euclidean", "squared", "cosine"] = Field(
        "euclidean", description="prototype distance: the paper's Euclidean, its square, or cosine (not the paper's: "
        "features L2-normalised, distances between unit vectors, scale-free; in [0, 2], so T small)")
    lr_sum: bool = Field(True, description="L_R as the paper's sum over classes of the distances (false: their "
                                           "mean over the batch's samples)")
    new_classes: Literal["batch", "start"] = Field(
        "batch", description="the prototype L_C and L_D use for a class the client has none of yet (the first round "
        "it meets it; the paper does not say): the batch's own class mean (detached), or the class mean over the "
        "client's data at the round's start, fixed for the round like the others (one more pass over the data)")
    prototypes: Literal["paper", "global", "local"] = Field(
        "paper", description="paper: each client classifies with its own prototypes, the server's library only "
        "in L_R; global: the server's library classifies too; local: nothing exchanged, L_R pulls to its own")


def distances(z: torch.Tensor, protos: torch.Tensor, kind: str = "euclidean") -> torch.Tensor:
    """[B, C] Euclidean distances, their squares (``squared``), or Euclidean distances between the unit vectors
    along the rows (``cosine``: sqrt(2 - 2 cos)); the gradient at distance 0 kept finite."""
    if kind == "cosine":
        z, protos = F.normalize(z, dim=-1), F.normalize(protos, dim=-1)
    sq = ((z * z).sum(1, keepdim=True) + (protos * protos).sum(1) - 2 * z @ protos.T).clamp(min=1e-8)
    return sq if kind == "squared" else sq.sqrt()


def row_distances(a: torch.Tensor, b: torch.Tensor, kind: str = "euclidean") -> torch.Tensor:
    """[N] the distance of ``kind`` (as :func:`distances`) between each row of ``a`` and the same row of ``b``."""
    if kind == "cosine":
        a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
    sq = ((a - b) ** 2).sum(1).clamp(min=1e-8)
    return sq if kind == "squared" else sq.sqrt()


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
        if self.own and len(self.setting.head_keys) != 2:
            raise ConfigError(f"protofcl: prototypes: {self.cfg.prototypes} predicts through the model's head, which "
                              "must be one linear layer (weight and bias); this model's head has "
                              f"{len(self.setting.head_keys)} parameters")

    @property
    def own(self) -> bool:
        """Each client classifies with its own prototypes (``paper``, ``local``)."""
        return self.cfg.prototypes != "global"

    @property
    def exchanged(self) -> bool:
        """Prototypes travel: the server's library is what clients classify with (``global``) or what L_R pulls
        to (``paper`` with beta > 0)."""
        return self.cfg.prototypes == "global" or (self.cfg.prototypes == "paper" and self.cfg.beta > 0)

    def broadcast(self, server, round_idx):
        return super().broadcast(server, round_idx) if self.exchanged else {}

    def aggregate(self, server, uploads, weights, round_idx, signals):
        if not self.exchanged:
            return server
        mean, count = self.senders_mean(uploads)  # (a class no one sent keeps its prototype)
        return {"protos": torch.where(count[:, None] > 0, mean, server["protos"]),
                "has": torch.maximum(server["has"], (count > 0).to(mean.dtype))}

    def init_client(self, init_params):
        dev = next(iter(init_params.values())).device
        protos = torch.zeros(self.num_classes, self.feature_dim, device=dev)  # the server's library's shape
        state = {**super().init_client(init_params), "model": clone(init_params), "teacher_protos": protos}
        if self.own:  # the client's own library
            state.update(protos=protos.clone(), has=torch.zeros(self.num_classes, device=dev))
        return state

    def library(self, payload, state) -> tuple[torch.Tensor, torch.Tensor]:
        """The prototypes [C, d] and which classes have one [C] that the client classifies with."""
        return (state["protos"], state["has"]) if self.own else (payload["protos"], payload["has"])

    def target(self, payload, state) -> tuple[torch.Tensor, torch.Tensor]:
        """The prototypes L_R pulls the batch's class means to, and which classes have one."""
        return (state["protos"], state["has"]) if self.cfg.prototypes == "local" else (payload["protos"],
                                                                                       payload["has"])

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
        z = F.normalize(z, dim=-1) if cfg.distance == "cosine" else z  # prototypes are means of unit features
        lib, has = self.library(ctx.payload, ctx.state)
        hot = onehot(ctx.y, self.num_classes, ctx.mask)
        count = hot.sum(0)
        local = hot.T @ z / count.clamp(min=1)[:, None]  # [C, d] the batch's class means (differentiable)
        in_batch = (count > 0).to(z.dtype)
        fill = local.detach()
        if cfg.new_classes == "start":  # the class means at the round's start (a probe at the received model)
            start = ctx.payload["own"][RECEIVED]["start"]
            fill = torch.where(start["count"][:, None] > 0, start["sum"] / start["count"].clamp(min=1)[:, None], fill)
        protos = torch.where(has[:, None] > 0, lib, fill)
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
            glob, has_glob = self.target(ctx.payload, ctx.state)
            gap = row_distances(local, glob, cfg.distance)
            l_r = (gap * in_batch * has_glob).sum() if cfg.lr_sum else \
                (gap * count * has_glob).sum() / count.sum().clamp(min=1)
            loss = loss + cfg.beta * ctx.term("l_r", l_r)
        return loss

    def probes(self, round_idx, payload):
        # prototypes are the features the client predicts with: BatchNorm at its running statistics
        start = [Probe("start", at="received", kind="sums", objective=self._class_sums, batchnorm="running")] \
            if self.cfg.new_classes == "start" else []
        return [*start, Probe("protos", kind="sums", objective=self._class_sums, batchnorm="running")]

    def _class_sums(self, ctx):
        return class_sums(ctx, self.num_classes, unit=self.cfg.distance == "cosine")

    def finish(self, params, state, payload, stats):
        count = stats["protos"]["count"]
        protos = stats["protos"]["sum"] / count.clamp(min=1)[:, None]
        sent = (count > 0).to(protos.dtype)
        upload = {"protos": protos, "has": sent} if self.exchanged else {}
        if not self.own:
            return upload, {**state, "model": params["model"]}
        # a class keeps its prototype until the client meets it again
        return upload, {**state, "model": params["model"], "has": torch.maximum(state["has"], sent),
                        "protos": torch.where(sent[:, None] > 0, protos, state["protos"])}

    def personal_params(self, state, payload):
        if not self.own:
            return state["model"]
        # nearest of the client's own prototypes through the model's linear head: argmin ||z - p_k|| is
        # argmax 2 z.p_k - ||p_k||^2, so weight 2P and bias -||P||^2 (classes without one: never chosen); cosine:
        # argmin ||z/|z| - p_k/|p_k||| is argmax z.p_k/|p_k|, so weight P/|P| and bias 0
        model, p, has = state["model"], state["protos"], state["has"]
        w, b = linear_head(model, self.setting.head_keys)
        if self.cfg.distance == "cosine":
            return {**model, w: F.normalize(p, dim=-1), b: torch.where(has > 0, 0.0, UNKNOWN)}
        return {**model, w: 2 * p, b: torch.where(has > 0, -(p * p).sum(1), UNKNOWN)}

    def eval_logits(self, z, logits, payload):
        if self.own:
            return logits
        return torch.where(payload["has"] > 0, -distances(z, payload["protos"], self.cfg.distance), float("-inf"))

    # ---- the prototype geometry, with every evaluation ----------------------------------------------------
    def client_report(self, state):
        if not self.own:
            return {}
        return {"protos": state["protos"], "has": state["has"]}

    def report(self, server, reports):
        """``proto_inter``: the mean over clients of the mean distance between two of its classes' prototypes;
        ``proto_spread``: the mean over classes held by two or more clients of the mean distance of a client's
        prototype of the class to the clients' mean of it; ``proto_spread_ratio`` the second over the first. With
        ``prototypes: global`` (no client keeps its own) the server library's inter-class distance. A measure with
        nothing to measure yet is left out."""
        if not self.own:
            return _defined(proto_inter_global=mean_pair_distance(server["protos"][None], server["has"][None]))
        protos, has = reports["protos"].double(), reports["has"].double()
        inter = mean_pair_distance(protos, has)
        holders = has.sum(0)  # [C] clients holding each class
        centre = torch.einsum("kc,kcd->cd", has, protos) / holders.clamp(min=1)[:, None]
        dist = (protos - centre).norm(dim=-1) * has  # [K, C]
        many = holders > 1
        spread = float((dist.sum(0)[many] / holders[many]).mean()) if many.any() else None
        ratio = spread / inter if spread is not None and inter else None
        return _defined(proto_inter=inter, proto_spread=spread, proto_spread_ratio=ratio)


def mean_pair_distance(protos: torch.Tensor, has: torch.Tensor) -> float | None:
    """The mean over libraries (``protos`` [K, C, d], ``has`` [K, C]) holding two or more classes of the mean
    Euclidean distance between two of its classes' prototypes (None if none holds two)."""
    out = [float(torch.pdist(p[h > 0].double()).mean()) for p, h in zip(protos, has) if int((h > 0).sum()) > 1]
    return sum(out) / len(out) if out else None


def _defined(**measures) -> dict:
    return {k: v for k, v in measures.items() if v is not None}
