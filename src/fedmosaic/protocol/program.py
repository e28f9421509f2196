"""Round programs: what an algorithm declares a client does in one round, as data the engine executes.

A round of a client is a list of :class:`Phase` s. A phase draws batches from a :class:`View` of the client's train
split (all of it, a support or query part, a fraction drawn afresh every round), for a number of epochs or a fixed
number of steps, optionally with a second batch per step from another view (``pair``: Per-FedAvg's D', FedMeta's
query batch). Every step runs its :class:`Step` s in order on that batch: each trains some slots with its own
objective, learning rate and optimiser state (pFedMe: K steps on the personal model, then one on the local copy).
Between phases a per-client update (``before``/``after``: pure tensor functions of one client, mapped over the cohort
like everything else) may change the trainable trees and the client's state (pFedSRB's soft-threshold and dual
update). :class:`Probe` s measure gradients over the client's data at the parameters it received or at its final
ones, and hand per-client sums to ``finish`` (FedCurv's Fisher, APFL-PD's importance).

The default program is one phase, one step, every slot, the algorithm's ``loss``: today's single-phase round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass(frozen=True)
class View:
    """Which of a client's train samples a phase draws from.

    ``all``: every sample. ``support`` / ``query``: a fixed split of the client's samples (the first ``frac`` of a
    permutation seeded by (run seed, client), the rest), the same in every round. ``sample``: a random ``frac`` of the
    client's samples, drawn again every round (FedALA's s%). ``public``: not the client's data but the run's shared
    public stream (``data.public``: noise images or an unlabeled dataset), every client drawing the same batches in
    the same order; an objective sees the batch's sample indices into the stream as ``ctx.y`` (there are no labels).
    ``next`` (only as a phase's ``pair``): each step takes 2B samples of the phase's own shuffle of its view, the
    first B its batch and the other B its paired batch, so the two never share a sample and an epoch is ceil(n / 2B)
    steps (Per-FedAvg's D and D', as PFLlib's clientperavg cuts one batch of 2B)."""

    part: Literal["all", "support", "query", "sample", "public", "next"] = "all"
    frac: float = 1.0

    def __post_init__(self):
        if not 0 < self.frac <= 1:
            raise ValueError(f"View.frac must be in (0, 1] (got {self.frac})")


ALL = View()


@dataclass(frozen=True)
class Step:
    """One update inside a step: the ``slots`` it trains (None: all), its objective (None: the algorithm's
    ``loss``), its learning rate (None: the round's) and an optional projection: every trained value clipped to
    ``clamp = (low, high)`` after the update (FedALA's aggregation weights in [0, 1]).

    ``plain``: a plain gradient step ``w -= lr * g`` — not the run's optimiser (no momentum, weight decay or Adam
    state). For an algorithm's internal updates whose paper writes a plain step (FedALA's A, pFedMe's theta and
    local model, Per-FedAvg's beta step): weight decay would shrink them where their gradient is 0."""

    slots: tuple[str, ...] | None = None
    objective: Callable | None = None
    lr: float | None = None
    clamp: tuple[float, float] | None = None
    plain: bool = False


@dataclass(frozen=True)
class Phase:
    """A stretch of local training. ``epochs`` (None: ``train.local_epochs``) passes over ``view`` or, when
    ``steps`` is set, exactly that many steps (cycling through fresh permutations). ``batch`` (None:
    ``train.batch_size``). ``before``/``after``: ``fn(params, state, payload) -> (params, state)`` for one client.
    ``key`` names the phase's batch schedule (None: its position in the program): phases with the same key draw the
    same batches, and key 0 is the single-phase round's — so a training phase placed after a preparatory one can
    keep the batch order of the methods it is compared with (FedALA).

    ``until``: a convergence loop, per client. After the phase's batches have run, every client for which
    ``until(losses, params, state, payload)`` (one client, mapped) is False runs the same batches again, in the same
    order, and so on until it is True or the phase has run ``1 + max_repeats`` times; the others are dropped.
    ``losses`` [runs so far] holds per run the loss of the client's last step (FedALA's start phase: A is trained
    until the std of the last 10 such losses falls below a threshold)."""

    epochs: int | None = None
    steps: int | None = None
    view: View = ALL
    pair: View | None = None
    batch: int | None = None
    updates: tuple[Step, ...] = (Step(),)
    before: Callable | None = None
    after: Callable | None = None
    key: int | None = None
    until: Callable | None = None
    max_repeats: int = 0

    def __post_init__(self):
        if self.view.part == "next":
            raise ValueError("View('next') is a pair: the batch after the step's own")

    @property
    def plain(self) -> bool:
        """The default phase shape, which the compiled fused path runs."""
        return self.pair is None and self.updates == (Step(),) and self.view == ALL and self.until is None


#: where the probes at the received parameters reach the objectives: ``ctx.payload["own"][RECEIVED][name]``
RECEIVED = "received"


@dataclass(frozen=True)
class Probe:
    """Gradients of ``objective`` (None: the algorithm's ``post_grad_loss``) with respect to ``slots`` (None: all)
    over the client's data, reaching ``finish`` as ``stats[name]`` (a tree by slot).

    ``at``: the parameters the client received (after ``local_init``) or its final ones; a probe at the received
    ones also reaches the round's objectives, as ``ctx.payload["own"]["received"][name]`` (ProtoFCL's class means at
    the round's start). ``kind``: ``grad_sq`` the
    mean over minibatches of the squared minibatch gradient (a diagonal Fisher estimate), ``grad`` the gradient of the
    mean loss over the samples, ``sums`` no gradient: the sums over the samples of ``objective(ctx)`` — a dict of
    per-batch sums, default the algorithm's ``accumulate`` — (features per class, logits, counts: FedPAC's
    statistics, prototypes at the final model). ``samples``: the client's first batches of the round holding that
    many samples, or None for one pass over all of its samples. ``batchnorm``: BatchNorm layers at the batch's
    statistics, as training has them, or at their running statistics, as prediction has them (features a client
    predicts with: ProtoFCL's prototypes)."""

    name: str
    at: Literal["received", "final"] = "final"
    kind: Literal["grad_sq", "grad", "sums"] = "grad_sq"
    samples: int | None = None
    objective: Callable | None = None
    slots: tuple[str, ...] | None = None
    batchnorm: Literal["batch", "running"] = "batch"


@dataclass(frozen=True)
class Setting:
    """What an algorithm knows about the run it is built for (given to its constructor)."""

    num_classes: int = 10
    feature_dim: int = 0
    num_clients: int = 1
    optimizer: object = None  # the local optimiser's config (FedNova and SCAFFOLD need its momentum)
    local_epochs: int = 1
    batch_size: int = 1
    head_keys: tuple[str, ...] = ()  # the parameters of the model's classifier head (the others: its features)
    models: dict = field(default_factory=dict)  # slot -> initial parameters of its own architecture (extra_models)
    rounds: int = 1  # train.rounds (schedules over the run: FedKD's SVD energy threshold)
    rounds_per_task: int = 0  # data.tasks.rounds_per_task (0: no task stream); FedWeIT's server fills its knowledge base
    n_tasks: int = 0  # data.tasks.n_tasks: the most tasks a client's stream holds (FedWeIT's knowledge-base size)
    init: dict = field(default_factory=dict)  # the run's initial model (the first architecture's): FedWeIT's B_0
    norm_keys: tuple[str, ...] = ()  # the parameters of the model's BatchNorm layers (FedBN keeps them local)
    trained_clients: int = 0  # the clients that train: num_clients less participation.held_out's (0: all of them)


@dataclass
class Signals:
    """What the server learns from a round besides the uploads: per cohort client its id, mean training loss and
    number of local steps, and the round's learning rate."""

    clients: torch.Tensor
    loss: torch.Tensor
    steps: torch.Tensor
    lr: float
