"""FedProto (Tan et al.): clients share class prototypes (mean features), never weights, so architectures may differ.

Local loss: task loss + lam * MSE(feature, global prototype of its class). Local prototypes are the per-class means of
the features seen during the round's local training (as the reference implementation collects them); the global
prototype of a class is the unweighted mean over the clients that hold it.
"""

from typing import Literal

import torch
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import TaskLoss
from ..protocol.tree import clone
from .terms import PrototypeMSE, class_sums


class FedProtoConfig(AlgoConfig):
    lam: float = Field(1.0, ge=0, description="weight of the prototype MSE term")
    predict: Literal["logits", "prototype"] = Field(
        "logits", description="evaluate with the model's head, or by nearest global prototype (Euclidean)"
    )


class PrototypeServer:
    """Mixin: a server that holds one prototype per class (``protos`` [C, d], ``has`` [C]) and sends it to all."""

    def init_server(self, init_params):
        dev = next(iter(init_params[0].values())).device
        return {"protos": torch.zeros(self.num_classes, self.feature_dim, device=dev),
                "has": torch.zeros(self.num_classes, device=dev)}

    def broadcast(self, server, round_idx):
        return {"protos": server["protos"], "has": server["has"]}

    @staticmethod
    def senders_mean(uploads) -> tuple[torch.Tensor, torch.Tensor]:
        """([C, d] each class's unweighted mean prototype over the clients that sent it, [C] how many did)."""
        has = uploads["has"]  # [n, C]
        count = has.sum(0)
        return torch.einsum("nc,ncd->cd", has, uploads["protos"]) / count.clamp(min=1)[:, None], count


@register_algorithm
class FedProto(PrototypeServer, Algorithm):
    name = "fedproto"
    personalized = True
    Config = FedProtoConfig
    global_model = False
    shares_features = True

    def aggregate(self, server, uploads, weights, round_idx, signals):
        protos, count = self.senders_mean(uploads)
        return {"protos": protos, "has": (count > 0).to(protos.dtype)}

    def init_client(self, init_params):
        return {"model": clone(init_params)}

    def local_init(self, payload, state):
        return {"model": state["model"]}

    def terms(self):
        return [TaskLoss(), PrototypeMSE(self.cfg.lam)]

    def accumulate(self, ctx):
        return class_sums(ctx, self.num_classes)  # (the engine detaches what is accumulated)

    def finish(self, params, state, payload, stats):
        count = stats["acc"]["count"]
        protos = stats["acc"]["sum"] / count.clamp(min=1)[:, None]
        return {"protos": protos, "has": (count > 0).to(protos.dtype)}, {"model": params["model"]}

    def personal_params(self, state, payload):
        return state["model"]

    def eval_logits(self, z, logits, payload):
        if self.cfg.predict == "logits":
            return logits
        dist = torch.cdist(z, payload["protos"])
        return torch.where(payload["has"] > 0, -dist, torch.full_like(dist, float("-inf")))
