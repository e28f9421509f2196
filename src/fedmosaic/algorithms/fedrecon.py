"""FedRecon: federated reconnaissance (Hendryx et al., "Federated Reconnaissance: Efficient, Distributed,
Class-Incremental Learning", arXiv:2109.00150; code ml4ai/fed-recon) — a prototypical network whose encoder is
frozen, with class prototypes merged across clients.

Every client adds the embeddings of the examples it meets to a running mean per class (p_c += (k / n_c)(p̂_c − p_c):
here its sum and count) and sends the server what it has not sent yet; the server merges the clients' prototypes
weighted by their sample counts, so each merged prototype is exactly the mean embedding of every example of its
class that any client has seen, whatever the order of the merges, and merging again with nothing new changes
nothing. Prediction: the nearest merged prototype by squared Euclidean distance (``FederatedProtoNet`` in the
authors' ``fed_recon/models/protonet/model.py``: ``update_prototype_for_class``, ``get_protonet_accuracy``).

One difference from that code, deliberately: its ``merge_models`` folds each client's whole prototype (which already
holds the server's, the client having started from it) into the server's with the weight of the client's new
examples only, which is the mean over every example only when the class is new to the server; the paper's rule, and
the commented "implementation following paper" beside it, is the count-weighted mean, built here (clients send their
new sums and counts).

The encoder (``encoder``): the authors pre-train it on held-out base classes and freeze it. ``initial``: the run's
initial model is the frozen encoder (register a model that loads pre-trained weights: fedmosaic downloads none);
``first_task``: it is trained federatedly (FedAvg, cross-entropy over the task's classes, a linear head) in the first
task's rounds but its last, then frozen — the last round of the first task computes the first prototypes with the
frozen encoder (so a task of at least 2 rounds is needed). How the ProtoFCL paper adapted FedRecon (it reports
FedRecon sending a full model every round) is unknown; docs/results.md says which the tables use.

Clients report prototypes only from the frozen encoder; a frozen round trains nothing (an epoch of steps at learning
rate 0, then a pass over the client's data for its class sums; BatchNorm statistics would still move in it: use a
model without, as fedmosaic's GroupNorm default), and its upload still carries the model (the engine's
uploads have one layout in every round; the server ignores it). Before any prototype exists (the first task's
training rounds) the global model predicts with its head.
"""

from typing import Literal

import torch
from pydantic import Field

from ..errors import ConfigError
from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import TaskLoss
from ..protocol.program import Phase, Probe, Step
from ..protocol.tree import weighted_mean
from .terms import class_sums

#: A frozen round's program: one epoch of plain steps at learning rate 0 — it changes nothing, but the probe that
#: follows passes over the batches of a round's first epoch
FROZEN = [Phase(epochs=1, updates=(Step(lr=0.0, plain=True),))]


class FedReconConfig(AlgoConfig):
    encoder: Literal["first_task", "initial"] = Field(
        "first_task", description="the frozen encoder: first_task — trained federatedly in the first task's rounds "
        "but its last, then frozen; initial — the run's initial model (a pre-trained model), frozen from round 0")


@register_algorithm
class FedRecon(Algorithm):
    name = "fedrecon"
    Config = FedReconConfig
    needs_tasks = True

    def __init__(self, cfg=None, setting=None):
        super().__init__(cfg, setting)
        if self.cfg.encoder == "first_task" and self.setting.rounds_per_task == 1:
            raise ConfigError("fedrecon: encoder: first_task trains the encoder in the first task's rounds but its "
                              "last, which computes the prototypes with it frozen: data.tasks.rounds_per_task must "
                              "be at least 2 (or use encoder: initial)")

    def frozen(self, round_idx: int) -> bool:
        return self.cfg.encoder == "initial" or round_idx >= self.setting.rounds_per_task - 1

    def init_server(self, init_params):
        dev = next(iter(init_params[0].values())).device
        return {"model": init_params[0], "sums": torch.zeros(self.num_classes, self.feature_dim, device=dev),
                "counts": torch.zeros(self.num_classes, device=dev)}

    def broadcast(self, server, round_idx):
        counts = server["counts"]
        return {"global": server["model"], "protos": server["sums"] / counts.clamp(min=1)[:, None],
                "has": (counts > 0).to(counts.dtype)}

    def program(self, round_idx):
        return FROZEN if self.frozen(round_idx) else [Phase()]

    def terms(self):
        return [TaskLoss()]

    def probes(self, round_idx, payload):
        return [Probe("sums", kind="sums", objective=self._class_sums)] if self.frozen(round_idx) else []

    def _class_sums(self, ctx):
        """The class sums of the current task's examples (an exemplar memory's were sent in their own task)."""
        sums = class_sums(ctx, self.num_classes)
        task = ctx.payload["own"]["task_classes"]
        return {"sum": sums["sum"] * task[:, None], "count": sums["count"] * task}

    def init_client(self, init_params):
        dev = next(iter(init_params.values())).device
        return {"sent_sum": torch.zeros(self.num_classes, self.feature_dim, device=dev),
                "sent_count": torch.zeros(self.num_classes, device=dev)}

    def finish(self, params, state, payload, stats):
        """What the client has not sent yet of its current task's class sums (nothing while the encoder trains;
        nothing new in a second round of a task: its data and the frozen encoder are the same)."""
        if "sums" not in stats:  # the encoder is still training: no prototypes yet
            zero = {"sum": torch.zeros_like(state["sent_sum"]), "count": torch.zeros_like(state["sent_count"])}
            return {"model": params["model"], "d_sum": zero["sum"], "d_count": zero["count"]}, state
        now = stats["sums"]
        upload = {"model": params["model"], "d_sum": now["sum"] - state["sent_sum"],
                  "d_count": now["count"] - state["sent_count"]}
        return upload, {"sent_sum": now["sum"], "sent_count": now["count"]}

    def aggregate(self, server, uploads, weights, round_idx, signals):
        model = server["model"] if self.frozen(round_idx) else weighted_mean(uploads["model"], weights)
        return {"model": model, "sums": server["sums"] + uploads["d_sum"].sum(0),
                "counts": server["counts"] + uploads["d_count"].sum(0)}

    def end_task(self, state, model, stats, seen, payload):
        # the next task's examples are new: what is sent of them starts from nothing
        return {"sent_sum": torch.zeros_like(state["sent_sum"]), "sent_count": torch.zeros_like(state["sent_count"])}

    def eval_logits(self, z, logits, payload):
        has = payload["has"]
        d2 = ((z * z).sum(1, keepdim=True) + (payload["protos"] ** 2).sum(1) - 2 * z @ payload["protos"].T)
        protos = torch.where(has > 0, -d2, float("-inf"))
        return torch.where(has.sum() > 0, protos, logits)
