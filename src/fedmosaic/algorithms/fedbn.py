"""FedBN (Li et al. 2021, "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization"): FedAvg in
which every client keeps its BatchNorm layers — their affine weight and bias, and their running statistics — and
the server averages every other parameter. A client's model is the averaged parameters with its own BatchNorm.

The authors' code (med-air/FedBN, ``federated/fed_digits.py`` ``communication``) keeps local every state-dict entry
whose name contains ``bn``; here the BatchNorm layers are found by their type (``models.norm_keys``), whatever they
are named. Their average is uniform over the clients; here weighted by train size, so that on a model without
BatchNorm FedBN is FedAvg exactly. There is no global model (each client predicts with its own BatchNorm).
"""

from __future__ import annotations

from ..protocol.algorithm import Algorithm, register_algorithm
from ..protocol.tree import split_keys, weighted_mean


@register_algorithm
class FedBN(Algorithm):
    name = "fedbn"
    personalized = True
    global_model = False  # (so every client keeps its own BatchNorm statistics, as it keeps its own weights)
    shares_weights = True  # every parameter but the BatchNorm layers' averaged: one architecture
    averages = ("shared", "shared")

    def _part(self, tree: dict, norm: bool) -> dict:
        return split_keys(tree, self.setting.norm_keys)[norm]

    def init_server(self, init_params):
        return {"shared": self._part(init_params[0], False)}

    def broadcast(self, server, round_idx):
        return {"global": server["shared"]}

    def aggregate(self, server, uploads, weights, round_idx, signals):
        return {"shared": weighted_mean(uploads["shared"], weights)}

    def init_client(self, init_params):
        return {"norm": self._part(init_params, True)}

    def local_init(self, payload, state):
        return {"model": {**payload["global"], **state["norm"]}}

    def finish(self, params, state, payload, stats):
        return {"shared": self._part(params["model"], False)}, {"norm": self._part(params["model"], True)}

    def personal_params(self, state, payload):
        return {**payload["global"], **state["norm"]}
