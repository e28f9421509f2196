"""IFCA (Ghosh, Chung, Yin, Ramchandran 2020, "An Efficient Framework for Clustered Federated Learning"): the server
keeps ``clusters`` models; each round a client estimates its cluster as the model of lowest loss on its train data
(one pass at the models it received), trains that model alone and uploads it; the server averages each model over
the clients that chose it (weighted by train size) and keeps a model nobody chose. The model-averaging variant of
the authors' code (jichan3751/ifca, ``mnist/train_cluster_mnist.py``, ``cifar/train_cluster_cifar_tf.py``).

The models start from different random draws: model 0 is the run's initial model, model j > 0 a permutation (seeded
by j) of each of its tensors' entries — a draw from the same elementwise-independent initialisation. A client is
evaluated with the model it chose when it last trained (the authors' FEMNIST rule; on MNIST/CIFAR they let each
test client choose on its test data, which here no client reads); one that never trained, with model 0.
``clusters: 1`` is FedAvg exactly.
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import LocalContext
from ..protocol.program import RECEIVED, Probe
from ..protocol.tree import tmap, weighted_mean


class IFCAConfig(AlgoConfig):
    clusters: int = Field(2, ge=1, le=64, description="the cluster models (the authors' 2 for CIFAR, 4 for MNIST)")


def _pick(models: dict, onehot: torch.Tensor) -> dict:
    """The model ``onehot`` points at, as a sum (differentiable in the chosen one only)."""
    return tmap(lambda t: torch.tensordot(onehot.to(t.dtype), t, dims=1), models)


@register_algorithm
class IFCA(Algorithm):
    name = "ifca"
    Config = IFCAConfig
    personalized = True
    global_model = False
    shares_weights = True  # the cluster models: one architecture

    def init_server(self, init_params):
        init, k = init_params[0], self.cfg.clusters

        def draws(t):
            out = [t]
            for j in range(1, k):
                g = torch.Generator().manual_seed(j)
                out.append(t.flatten()[torch.randperm(t.numel(), generator=g).to(t.device)].view_as(t))
            return torch.stack(out)

        return {"models": tmap(draws, init)}

    def broadcast(self, server, round_idx):
        return {"models": server["models"]}

    def init_client(self, init_params):
        dev = next(iter(init_params.values())).device
        return {"choice": torch.zeros(self.cfg.clusters, device=dev)}

    def local_init(self, payload, state):
        return {"models": payload["models"]}

    def probes(self, round_idx, payload):
        return [Probe("losses", at="received", kind="sums", objective=self._losses)]

    def _losses(self, ctx: LocalContext) -> dict:
        """Per cluster model the batch's summed task loss."""
        n = ctx.mask.sum()
        return {"sum": torch.stack([ctx.task_loss_of(tmap(lambda t, j=j: t[j], ctx.params["models"])) * n
                                    for j in range(self.cfg.clusters)])}

    def _choice(self, losses: torch.Tensor) -> torch.Tensor:
        return (torch.arange(self.cfg.clusters, device=losses.device) == losses.argmin()).to(losses.dtype)

    def loss(self, ctx: LocalContext) -> torch.Tensor:
        onehot = self._choice(ctx.payload["own"][RECEIVED]["losses"]["sum"])
        return ctx.task_loss_of(_pick(ctx.params["models"], onehot))

    def finish(self, params, state, payload, stats):
        onehot = self._choice(stats["losses"]["sum"])
        return {"model": _pick(params["models"], onehot), "choice": onehot}, {"choice": onehot}

    def aggregate(self, server, uploads, weights, round_idx, signals):
        models = []
        for j in range(self.cfg.clusters):
            w = weights * uploads["choice"][:, j]
            old = tmap(lambda t, j=j: t[j], server["models"])
            models.append(weighted_mean(uploads["model"], w) if bool(w.sum() > 0) else old)
        return {"models": tmap(lambda *ts: torch.stack(ts), *models)}

    def personal_params(self, state, payload):
        chosen = state["choice"]
        first = (torch.arange(self.cfg.clusters, device=chosen.device) == 0).to(chosen.dtype)
        return _pick(payload["models"], torch.where(chosen.sum() > 0, chosen, first))
