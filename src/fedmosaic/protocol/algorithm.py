"""The algorithm boundary. An algorithm declares state, payload, the round program (phases, objectives, probes),
upload and aggregation; the engine owns rounds, cohorts, batches, optimisers and where local training runs.

Client-side hooks (``init_client``, ``local_init``, the objectives, ``accumulate``, the program's ``before``/
``after`` updates, ``finish``, ``personal_params``) are written for ONE client and must be pure tensor functions:
the engine maps them over the cohort with ``torch.func.vmap`` (fast path) or a Python loop (sequential path), with
identical results. Server-side hooks see the whole cohort's uploads stacked.

Slots: ``local_init`` returns the trainable trees by name (``{"model": ...}``, Ditto's ``{"model", "personal"}``);
terms and program steps name the slots they use, and the engine checks those names against ``local_init`` before
the first round.
"""

from __future__ import annotations

import importlib
import inspect
from typing import ClassVar

import torch

from ..errors import ConfigError
from ..schema import Schema
from .context import LocalContext, TaskLoss, term_name
from .program import Phase, Probe, Setting, Signals
from .tree import weighted_mean


class AlgoConfig(Schema):
    """An algorithm's hyper-parameters: strict types, finite numbers, each with its range."""


class Algorithm:
    name: ClassVar[str]
    Config: ClassVar[type[AlgoConfig]] = AlgoConfig
    #: True when the server keeps one model that every client trains (so all clients need one architecture).
    global_model: ClassVar[bool] = True
    #: True when clients have models of their own (``personal_params`` or ``finetune``): personalized metrics.
    personalized: ClassVar[bool] = False
    #: True: the engine pools every client's train samples and deals them out again at random (sizes kept).
    pooled: ClassVar[bool] = False
    #: The slot whose architecture evaluates personal models (None: the run's model; FedKD: its private mentor).
    personal_slot: ClassVar[str | None] = None
    #: True when the server averages part of the clients' weights although it keeps no global model (FedWeIT's
    #: base B): as with ``global_model``, every client needs the same architecture.
    shares_weights: ClassVar[bool] = False
    #: True when clients exchange features (prototypes), so every architecture needs one feature size.
    shares_features: ClassVar[bool] = False
    #: True: before each round's training every cohort client sends its logits on the public stream
    #: (``data.public``) and the server folds them into its state with :meth:`exchange` (AHF, FedMD, FedDF, ...).
    exchanges: ClassVar[bool] = False
    #: True when the algorithm trains on the public stream (``data.public``), which it then needs: it exchanges
    #: outputs on it (``exchanges``), the server trains on it (``server_program``: FedDF) or a phase of its round
    #: draws from it (``View("public")``: CFeD's review). Without it, a ``data.public`` would be ignored.
    uses_public: ClassVar[bool] = False
    #: True for class-incremental methods, which act at the ends of tasks and so need task streams (``data.tasks``):
    #: without them FedLwF and FedEWC would be FedAvg exactly.
    needs_tasks: ClassVar[bool] = False
    #: True when the algorithm keeps the warmed-up model as a teacher (FCCL): ``train.warmup_epochs`` must be >= 1.
    needs_warmup: ClassVar[bool] = False
    #: How the exemplar memory of a task stream picks the samples it keeps (``data.tasks.memory.select: auto``).
    memory_select: ClassVar[str] = "herding"
    #: (upload key, server-state key) for an :meth:`aggregate` of its own that sets the entries of
    #: ``server[state key]`` to a mean of the rows of ``uploads[upload key]`` — weighted as it is given, or equally
    #: (pFedSRB's plain mean), a client given weight 0 left out either way — and combines nothing else the clients
    #: send: the part a robust rule, an upload attack and a server optimizer act on (``engine/robust.py``; the
    #: default aggregate's is ("model", "model")). Read only where declared on the class of the aggregate or below
    #: it: a subclass with an aggregate of its own says it again. None: the server step is the algorithm's own.
    averages: ClassVar[tuple[str, str] | None] = None

    def __init__(self, cfg: AlgoConfig | None = None, setting: Setting | None = None):
        self.cfg = cfg if cfg is not None else self.Config()
        self.setting = setting if setting is not None else Setting()

    @property
    def num_classes(self) -> int:
        return self.setting.num_classes

    @property
    def feature_dim(self) -> int:
        return self.setting.feature_dim

    @property
    def num_clients(self) -> int:
        return self.setting.num_clients

    @property
    def trained_clients(self) -> int:
        """The federation's training population: its clients less those held out of training (the N of
        SCAFFOLD's and FedDyn's server rules, whose held-out clients never send a correction)."""
        return self.setting.trained_clients or self.setting.num_clients

    @property
    def optimizer(self):
        return self.setting.optimizer

    @classmethod
    def extra_models(cls, cfg: AlgoConfig, model) -> dict[str, tuple[str, dict]]:
        """Slots trained with an architecture of their own, as ``{slot: (model name, options)}`` (``model``: the
        run's ``model`` config); their initial parameters reach the algorithm as ``setting.models[slot]`` and
        ``ctx.forward(slot)`` runs them. FedKD's mentor; none by default."""
        return {}

    # ---- on the wire -------------------------------------------------------------------------------
    def pack_broadcast(self, payload: dict) -> dict:
        """The broadcast as it travels (default: as it is). An algorithm may leave out what a client rebuilds
        exactly in :meth:`unpack_broadcast` (FedWeIT: the knowledge base's empty entries)."""
        return payload

    def unpack_broadcast(self, body: dict) -> dict:
        return body

    def pack_upload(self, upload: dict) -> dict:
        """One client's upload (a stack of one) as it travels (default: as it is). An algorithm that compresses
        may cut what it keeps fixed-shaped for vmap (FedKD: the zeroed SVD components); :meth:`unpack_upload`
        restores the fixed shapes exactly."""
        return upload

    def unpack_upload(self, body: dict) -> dict:
        return body

    # ---- server side -------------------------------------------------------------------------------
    def init_server(self, init_params: list[dict]) -> dict:
        """Server state from the initial parameters of each architecture group."""
        return {"model": init_params[0]}

    def broadcast(self, server: dict, round_idx: int) -> dict:
        """The payload every cohort client receives this round."""
        return {"global": server["model"]}

    def client_payload(self, server: dict, clients: torch.Tensor) -> dict:
        """What the server sends each of ``clients`` alone (stacked in their order); it reaches the client hooks as
        ``payload["own"]``, next to its id ``cid``."""
        return {}

    def aggregate(self, server: dict, uploads: dict, weights: torch.Tensor, round_idx: int,
                  signals: Signals) -> dict:
        """New server state from the cohort's stacked uploads; ``weights`` are the clients' train sizes,
        ``signals`` their mean training losses and step counts."""
        return {**server, "model": weighted_mean(uploads["model"], weights)}

    def exchange(self, server: dict, logits: torch.Tensor, clients: torch.Tensor, round_idx: int) -> dict:
        """With ``exchanges``: what the server sends every cohort client this round (merged into the broadcast)
        once it has received ``logits`` [n, N0, C], the cohort's outputs on the public stream at the models they
        start the round from (``clients`` [n]: their ids, in that order). Default: all of them."""
        return {"logits": logits, "clients": clients}

    def server_program(self, server: dict, round_idx: int) -> list[Phase] | None:
        """Phases the server runs after :meth:`aggregate` on the public stream, training ``server["model"]`` as one
        more "client" (FedDF's ensemble distillation). Its objectives see the cohort's uploaded models' logits on the
        stream through the payload :meth:`exchange` makes of them. None: no server training."""
        return None

    def round_lr(self, server: dict, round_idx: int, lr: float) -> float:
        """The local learning rate of round ``round_idx`` (``lr``: the configured schedule's)."""
        return lr

    # ---- the round program -------------------------------------------------------------------------
    def program(self, round_idx: int) -> list[Phase]:
        """What a client does this round: one phase over its train split with :meth:`loss` (the default)."""
        return [Phase()]

    def probes(self, round_idx: int, payload: dict) -> list[Probe]:
        """Gradient passes whose results reach :meth:`finish` as ``stats[probe.name]``; ``payload``: this round's
        :meth:`broadcast` (the same for every cohort client)."""
        return []

    def finetune(self) -> list[Phase] | None:
        """Phases each client runs from ``local_init`` before its personal model is evaluated (nothing uploaded,
        nothing kept): Per-FedAvg's adaptation step, FedAvg + fine-tuning. The personal model is then the ``model``
        slot, or without one the union of the slots (FedBABU's body and head). None: no fine-tuning."""
        return None

    # ---- client side (one client; vmapped) ----------------------------------------------------------
    def init_client(self, init_params: dict) -> dict:
        """Persistent per-client state, created once for every client (stacked in the client store) from the
        initial parameters of its architecture."""
        return {}

    def after_warmup(self, state: dict) -> dict:
        """A client's state once its own model (``state["model"]``) was warmed up on its private data
        (``train.warmup_epochs``): FCCL keeps a frozen copy."""
        return state

    def local_init(self, payload: dict, state: dict) -> dict:
        """The trainable trees, by slot, that local training starts from."""
        return {"model": payload["global"]}

    def terms(self) -> list:
        """The local objective as a list of terms (summed)."""
        return [TaskLoss()]

    def loss(self, ctx: LocalContext) -> torch.Tensor:
        """The sum of :meth:`terms`; with several, each is recorded under its name (:func:`term_name`)."""
        first, *rest = self.terms()
        if not rest:
            return first(ctx)
        loss = ctx.term(term_name(first), first(ctx))  # (not ``sum``: its 0 + loss is one more op in every step)
        for term in rest:
            loss = loss + ctx.term(term_name(term), term(ctx))
        return loss

    def post_grad_loss(self, ctx: LocalContext) -> torch.Tensor:
        """The default objective of probes: the task loss alone (FedCurv's Fisher is measured on the data term,
        not on the whole objective with its penalties)."""
        return TaskLoss()(ctx)

    def accumulate(self, ctx: LocalContext) -> dict:
        """Per-step statistics summed over the client's local steps (e.g. prototype sums); detached."""
        return {}

    def finish(self, params: dict, state: dict, payload: dict, stats: dict) -> tuple[dict, dict]:
        """After local training: (upload, new persistent state).

        ``stats`` (per client): ``n`` train samples, ``steps`` local steps taken, ``lr``, ``acc`` (the sums of
        :meth:`accumulate`) and one entry per probe.
        """
        return {"model": params["model"]}, state

    # ---- task streams (class-incremental FL) -----------------------------------------------------------
    def task_probes(self) -> list[Probe]:
        """Gradient passes over every client's samples of the task that just ended, at its final model (the model
        it predicts with), reaching :meth:`end_task` as ``stats`` (FedEWC's Fisher)."""
        return []

    def end_task(self, state: dict, model: dict, stats: dict, seen: torch.Tensor, payload: dict) -> dict:
        """A client's state once a task has ended (every client, at the last round of each task; one client,
        vmapped): ``model`` the parameters it predicts with at that moment (the global model, or its own),
        ``stats`` the :meth:`task_probes`, ``seen`` [C] the classes the federation has met so far (1/0),
        ``payload`` what the server would broadcast now. Keep the previous task's model as a teacher here (FedLwF,
        ProtoFCL, with the prototypes it predicted with)."""
        return state

    # ---- evaluation -------------------------------------------------------------------------------
    def global_params(self, server: dict) -> dict | None:
        return server.get("model")

    def personal_params(self, state: dict, payload: dict) -> dict | None:
        """A client's personalized model from its state and what it was sent: ``payload`` is the
        :meth:`broadcast` with its :meth:`client_payload` as ``payload["own"]`` (with its ``cid``; one client;
        vmapped), or None if the algorithm has none. Only asked when ``personalized`` is set and there is no
        ``finetune``."""
        return None

    def personal_forward(self, apply, params: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, logits) of a client's personal model on ``x``: ``params`` is :meth:`personal_params` (with
        the model's buffers), ``apply(tree, x)`` runs the architecture. Default: the tree is the model; APFL
        mixes the outputs of two."""
        return apply(params, x)

    def client_report(self, state: dict) -> dict:
        """Tensors a client reports of its state with every evaluation (one client; vmapped), for :meth:`report`."""
        return {}

    def report(self, server: dict, reports: dict) -> dict:
        """Extra metrics from the server state and the clients' :meth:`client_report` s, stacked in client order
        (e.g. the sparsity of personal parts); reported with every evaluation."""
        return {}

    def eval_logits(self, z: torch.Tensor, logits: torch.Tensor, payload: dict) -> torch.Tensor:
        """Scores used for prediction at evaluation time, from what a client was sent (``payload``: the
        :meth:`broadcast`; FedProto may use prototype distances instead)."""
        return logits


ALGORITHMS: dict[str, type[Algorithm]] = {}


#: hooks that run where a client's data is: they see what it was sent (the broadcast, its assignment), never the
#: server's state, so the same algorithm runs with the server in another process or on another machine
CLIENT_HOOKS = ("init_client", "after_warmup", "local_init", "program", "probes", "accumulate", "finish",
                "end_task", "personal_params", "personal_forward", "client_report", "eval_logits")


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ConfigError(f"register_algorithm: {cls!r} is not a subclass of fedmosaic.Algorithm")
    if not (isinstance(cls.Config, type) and issubclass(cls.Config, AlgoConfig)):
        raise ConfigError(f"register_algorithm({cls.name!r}): its Config must subclass fedmosaic.AlgoConfig "
                          "(strict: a misspelt hyper-parameter is refused, not ignored)")
    for hook in CLIENT_HOOKS:
        if "server" in inspect.signature(getattr(cls, hook)).parameters:
            wanted = ", ".join(list(inspect.signature(getattr(Algorithm, hook)).parameters)[1:])
            raise TypeError(f"algorithm {cls.name!r}: the client hook {hook} takes the server's state; it runs on "
                            f"the client and sees what was sent: {hook}({wanted})")
    if cls.__module__.startswith("fedmosaic."):
        if cls.name in ALGORITHMS:
            raise ValueError(f"algorithm {cls.name!r} registered twice")
    else:  # a plug-in's: owned like a dataset's or model's name, and runs record its module (plugins.used_by)
        from .. import plugins

        registered()  # the built-ins first, so that a plug-in cannot take one's name before they are imported
        plugins.claim("algorithm", cls.name, cls.name in ALGORITHMS, origin=cls.__module__)
    ALGORITHMS[cls.name] = cls
    return cls


def registered() -> dict[str, type[Algorithm]]:
    """Every registered algorithm, the built-in ones imported on first use: the engine names no algorithm itself."""
    importlib.import_module("fedmosaic.algorithms")
    return ALGORITHMS
