"""Split models: the model cut into its feature extractor (``body``) and its classifier (``head``: the parameters
``head()`` uses), one part federated — averaged by the server, weighted by train size, over the round's cohort —
and the other kept by each client between rounds. A client's model is the broadcast part with its own.

FedPer (Arivazhagan et al. 2019, "Federated Learning with Personalization Layers"): the body federated, the head
personal; local training trains both, for ``train.local_epochs`` epochs.

FedRep (Collins et al. 2021, "Exploiting Shared Representations for Personalized Federated Learning"): the body
federated, the head personal; a round trains the head alone first (``head_epochs`` epochs, the body fixed), then the
body alone (``train.local_epochs`` epochs, the head fixed), as the authors' code and PFLlib's clientrep do.

LG-FedAvg (Liang et al. 2020, "Think Locally, Act Globally"): the head federated ("global"), the body personal
("local representations"); local training trains both.

None keeps a global model (``global_model = False``: no global metrics; each client is evaluated with its own
model). Every client starts from the same initial model.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import TaskLoss
from ..protocol.program import Phase, Step
from ..protocol.tree import split_keys, weighted_mean

BOTH = ("body", "head")


class SplitModel(Algorithm):
    """One part of the model (``shared``: ``body`` or ``head``) federated, the other personal."""

    personalized = True
    global_model = False
    shares_weights = True  # the server averages one part of one architecture
    shared: ClassVar[str] = "body"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "aggregate" not in cls.__dict__:  # its server step: the mean of the part it shares (``Algorithm.averages``)
            cls.averages = (cls.shared, "shared")

    @property
    def own(self) -> str:
        return "head" if self.shared == "body" else "body"

    def part(self, tree: dict, which: str) -> dict:
        return split_keys(tree, self.setting.head_keys)[which == "head"]

    def init_server(self, init_params):
        return {"shared": self.part(init_params[0], self.shared)}

    def broadcast(self, server, round_idx):
        return {"global": server["shared"]}

    def aggregate(self, server, uploads, weights, round_idx, signals):
        return {"shared": weighted_mean(uploads[self.shared], weights)}

    def init_client(self, init_params):
        return {"own": self.part(init_params, self.own)}

    def local_init(self, payload, state):
        return {self.shared: payload["global"], self.own: state["own"]}

    def terms(self):
        return [TaskLoss(BOTH)]

    def finish(self, params, state, payload, stats):
        return {self.shared: params[self.shared]}, {"own": params[self.own]}

    def personal_params(self, state, payload):
        return {**payload["global"], **state["own"]}


@register_algorithm
class FedPer(SplitModel):
    """FedPer (Arivazhagan et al. 2019): the body federated, the head personal, both trained each round."""

    name = "fedper"


class FedRepConfig(AlgoConfig):
    head_epochs: int = Field(10, ge=0, le=10_000, description="epochs of head-only training before the body's "
                             "train.local_epochs (the authors' local_ep - local_rep_ep: 10 of their 11)")


@register_algorithm
class FedRep(SplitModel):
    """FedRep (Collins et al. 2021): the body federated, the head personal; the head trained first (``head_epochs``,
    body fixed), then the body (``train.local_epochs``, head fixed)."""

    name = "fedrep"
    Config = FedRepConfig

    def program(self, round_idx):
        head = Phase(epochs=self.cfg.head_epochs, updates=(Step(("head",)),), key=1)
        return [*([head] if self.cfg.head_epochs else []), Phase(updates=(Step(("body",)),), key=0)]


@register_algorithm
class LGFedAvg(SplitModel):
    """LG-FedAvg (Liang et al. 2020): the head federated, the body (local representation) personal."""

    name = "lg_fedavg"
    shared = "head"


class FedBABUConfig(AlgoConfig):
    ft_epochs: int = Field(5, ge=1, le=10_000, description="epochs of fine-tuning the whole model before a client's "
                           "personal model is evaluated (the authors' 5)")
    ft_lr: float | None = Field(1e-3, gt=0, description="their learning rate (the authors' 1e-3; None: the round's)")


@register_algorithm
class FedBABU(Algorithm):
    """FedBABU (Oh, Kim, Yun 2022, "Federated Learning with Only the Body Aggregated and Updated"): the head stays
    at its random initialisation during federated training (the authors' head learning rate 0), the body is
    trained and averaged; a client's personal model is the global model fine-tuned whole (body and head) for
    ``ft_epochs`` epochs at ``ft_lr`` on its train split before it is evaluated (nothing kept)."""

    name = "fedbabu"
    Config = FedBABUConfig
    personalized = True
    averages = ("body", "model")

    def local_init(self, payload, state):
        return dict(zip(BOTH, split_keys(payload["global"], self.setting.head_keys), strict=True))

    def terms(self):
        return [TaskLoss(BOTH)]

    def program(self, round_idx):
        return [Phase(updates=(Step(("body",)),))]

    def finish(self, params, state, payload, stats):
        return {"body": params["body"]}, state

    def aggregate(self, server, uploads, weights, round_idx, signals):
        return {**server, "model": {**server["model"], **weighted_mean(uploads["body"], weights)}}

    def finetune(self):
        return [Phase(epochs=self.cfg.ft_epochs, updates=(Step(lr=self.cfg.ft_lr),))]
