"""FedRoD (Chen & Chao 2022, "On Bridging Generic and Personalized Federated Learning for Image Classification"),
as PFLlib's ``clientrod`` implements it (the authors' repository holds no code).

The model (body and generic head) is trained on the balanced-softmax loss CE(z_g + log n, y), with n_c the client's
train samples of class c (a class it lacks gets log 0 = -inf: never its label, never predicted), and averaged by
the server as FedAvg's. Each client also keeps a personal head (the shape of the head, from the initial one),
trained in the same steps on CE(z_g + z_p, y) with z_p its output on the detached features and z_g detached: it
learns only what the generic head misses for this client. Personal prediction: z_g + z_p — the model whose head is
the sum of the two heads (the same logits). The global model (generic) is FedAvg's.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..protocol.algorithm import Algorithm, register_algorithm
from ..protocol.context import LocalContext, onehot, per_sample_task_loss
from ..protocol.program import RECEIVED, Probe
from ..protocol.tree import split_keys
from .terms import linear_head


@register_algorithm
class FedRoD(Algorithm):
    name = "fedrod"
    personalized = True

    def __init__(self, cfg=None, setting=None):
        super().__init__(cfg, setting)
        if setting is not None and len(self.setting.head_keys) != 2:
            raise ConfigError("fedrod: the personal head is a copy of the model's head, which must be one linear layer "
                              f"(weight and bias); this model's head has {len(self.setting.head_keys)} parameters")

    def init_client(self, init_params):
        return {"phead": split_keys(init_params, self.setting.head_keys)[1]}

    def local_init(self, payload, state):
        return {"model": payload["global"], "phead": state["phead"]}

    def probes(self, round_idx, payload):
        return [Probe("counts", at="received", kind="sums", objective=self._counts)]

    def _counts(self, ctx: LocalContext) -> dict:
        return {"n": onehot(ctx.y, self.num_classes, ctx.mask).sum(0)}

    def loss(self, ctx: LocalContext) -> torch.Tensor:
        z, zg = ctx.forward("model")
        n = ctx.payload["own"][RECEIVED]["counts"]["n"]
        log_n = torch.where(n > 0, n.clamp(min=1).log(), torch.full_like(n, -torch.inf))
        generic = ctx.term("bsm", ctx.mean(per_sample_task_loss("ce", zg + log_n, ctx.y)))
        w, b = linear_head(ctx.params["phead"], self.setting.head_keys)
        zp = z.detach() @ ctx.params["phead"][w].T + ctx.params["phead"][b]
        return generic + ctx.term("personal", ctx.mean(per_sample_task_loss("ce", zg.detach() + zp, ctx.y)))

    def finish(self, params, state, payload, stats):
        return {"model": params["model"]}, {"phead": params["phead"]}

    def personal_params(self, state, payload):
        model = payload["global"]
        return {**model, **{k: model[k] + state["phead"][k] for k in self.setting.head_keys}}

