"""The algorithm boundary. An algorithm declares state, payload, local objective, upload and aggregation;
the engine owns rounds, cohorts, batches, optimisers and where local training runs.

Client-side hooks (``init_client``, ``local_init``, ``local_step``'s objective, ``finish``) are written for ONE client
and must be pure tensor functions: the engine maps them over the cohort with ``torch.func.vmap`` (fast path) or a
Python loop (sequential path), with identical results. Server-side hooks see the whole cohort's uploads stacked.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from ..engine.tree import weighted_mean
from ..schema import Schema
from .terms import LocalContext, TaskLoss


class AlgoConfig(Schema):
    """An algorithm's hyper-parameters: strict types, finite numbers, each with its range."""


class Algorithm:
    name: ClassVar[str]
    Config: ClassVar[type[AlgoConfig]] = AlgoConfig
    #: True when the server keeps one model that every client trains (so all clients need one architecture).
    global_model: ClassVar[bool] = True
    #: After local training, the engine evaluates minibatch gradients at the final local parameters on this many
    #: samples (the client's first batches) and passes their mean square to ``finish`` as ``stats["grad_sq"]``.
    post_grad_samples: ClassVar[int] = 0

    def __init__(self, cfg: AlgoConfig | None = None):
        self.cfg = cfg if cfg is not None else self.Config()
        self.num_classes = 0
        self.feature_dim = 0
        self.num_clients = 0
        self.optimizer = None

    def bind(self, num_classes: int, feature_dim: int, num_clients: int, optimizer) -> None:
        """Told by the engine before ``init_server``: the class count, the models' feature size, the number of
        clients in the federation and the local optimiser's config (FedNova and SCAFFOLD need its momentum)."""
        self.num_classes, self.feature_dim = num_classes, feature_dim
        self.num_clients, self.optimizer = num_clients, optimizer

    # ---- server side -------------------------------------------------------------------------------
    def init_server(self, init_params: list[dict]) -> dict:
        """Server state from the initial parameters of each architecture group."""
        return {"model": init_params[0]}

    def broadcast(self, server: dict, round_idx: int) -> dict:
        """The payload every cohort client receives this round."""
        return {"global": server["model"]}

    def aggregate(self, server: dict, uploads: dict, weights: torch.Tensor, round_idx: int) -> dict:
        """New server state from the cohort's stacked uploads; ``weights`` are the clients' train sizes."""
        return {**server, "model": weighted_mean(uploads["model"], weights)}

    # ---- client side (one client; vmapped) ----------------------------------------------------------
    def init_client(self, server: dict, init_params: dict) -> dict:
        """Persistent per-client state, created once for every client (stacked in the client store)."""
        return {}

    def local_init(self, payload: dict, state: dict) -> dict:
        """The trainable trees, by slot, that local training starts from."""
        return {"model": payload["global"]}

    def terms(self) -> list:
        """The local objective as a list of terms (summed)."""
        return [TaskLoss()]

    def loss(self, ctx: LocalContext) -> torch.Tensor:
        return sum(term(ctx) for term in self.terms())

    def post_grad_loss(self, ctx: LocalContext) -> torch.Tensor:
        """The loss whose minibatch gradients ``stats["grad_sq"]`` squares: the task loss alone (FedCurv's Fisher
        is measured on the data term, not on the whole objective with its penalties)."""
        return TaskLoss()(ctx)

    def accumulate(self, ctx: LocalContext) -> dict:
        """Per-step statistics summed over the client's local steps (e.g. prototype sums); detached."""
        return {}

    def finish(self, params: dict, state: dict, payload: dict, stats: dict) -> tuple[dict, dict]:
        """After local training: (upload, new persistent state).

        ``stats`` (per client): ``n`` train samples, ``steps`` local steps taken, ``lr``, ``acc`` (the sums of
        :meth:`accumulate`) and, when ``post_grad_samples`` is set, ``grad_sq``.
        """
        return {"model": params["model"]}, state

    # ---- evaluation -------------------------------------------------------------------------------
    def global_params(self, server: dict) -> dict | None:
        return server.get("model")

    def personal_params(self, state: dict) -> dict | None:
        """A client's personalized model (one client; vmapped), or None if the algorithm has none."""
        return None

    def eval_logits(self, z: torch.Tensor, logits: torch.Tensor, server: dict) -> torch.Tensor:
        """Scores used for prediction at evaluation time (FedProto may use prototype distances instead)."""
        return logits


ALGORITHMS: dict[str, type[Algorithm]] = {}


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    if cls.name in ALGORITHMS:
        raise ValueError(f"algorithm {cls.name!r} registered twice")
    ALGORITHMS[cls.name] = cls
    return cls
