"""What a client's local objective sees: the :class:`LocalContext` of one client's step (its batch, its trees,
the forward passes of its slots), the supervised task loss, and the small helpers terms share (one-hot labels,
columns left out of a softmax). Algorithms build their terms on it (``algorithms/terms.py``); the engine builds it
for every step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch._C._functorch import is_batchedtensor


class LocalContext:
    """What a local objective sees for one client and one (padded) batch.

    ``params`` are the trainable trees by slot (e.g. ``{"model": ...}`` or Ditto's ``{"model", "personal"}``),
    ``state`` the client's persistent state, ``payload`` what the server broadcast. ``mask`` marks real samples in
    a padded batch; every per-sample quantity must be reduced with :meth:`mean`. ``pair`` is the step's second
    batch ``(x, y, mask)`` when the phase asks for one (Per-FedAvg's D', FedMeta's query batch), else None.
    ``payload["own"]`` is what the server sent this client alone; it always holds the client's id ``cid``.
    """

    def __init__(self, apply, params, state, payload, x, y, mask, task_loss: str = "ce", pair=None,
                 full: bool = False, frozen=None):
        self.apply, self.params, self.state, self.payload = apply, params, state, payload
        self._frozen = frozen  # (params, x, buffers) -> outputs of a teacher: eval mode, no gradient
        self.x, self.y, self.mask = x, y, mask
        self.full = full  # every sample of the batch is real (the looped path cuts partial batches): no masking
        self.task_loss, self.pair = task_loss, pair
        self._out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        #: the named parts of the objective computed on this batch (:meth:`term`), reported per round
        self.terms: dict[str, torch.Tensor] = {}

    def zero(self) -> torch.Tensor:
        """0 on the batch's device: what a term at weight 0 returns (a bare ``torch.zeros(())`` is a CPU tensor,
        which the engine's per-client sums on a GPU refuse)."""
        return self.y.new_zeros((), dtype=torch.float32)

    def term(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """``value``, recorded under ``name`` as one part of the objective: each part's mean over the round's steps
        goes to ``metrics.jsonl`` (``terms``) and ``report``, so nobody infers a term from two runs' difference.
        Several calls with one name add up."""
        v = value.detach()
        self.terms[name] = self.terms[name] + v if name in self.terms else v
        return value

    def forward(self, slot: str | tuple[str, ...] = "model") -> tuple[torch.Tensor, torch.Tensor]:
        """(features, logits) of the model in ``slot`` on this batch, computed once — with the architecture of that
        slot (FedKD's ``mentor``: ``Algorithm.extra_models``), else the run's model. A tuple of slots is one model
        whose parameters those slots hold together (FedPAC's ``("body", "head")``, each trained in its own step)."""
        if slot not in self._out:
            tree = self.params[slot] if isinstance(slot, str) else {k: v for s in slot for k, v in self.params[s].items()}
            self._out[slot] = self.apply(tree, self.x, slot=slot)
        return self._out[slot]

    def teacher(self, params, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, logits) of a frozen teacher model with ``params`` on this batch, detached, in eval mode: a
        BatchNorm teacher normalises with its own running statistics and never moves the student's. ``which``
        teacher it is says whose statistics those are: ``global`` the model received this round, ``local`` the
        client's own model from the end of its last round, ``task`` the model it predicted with at the end of its
        previous task (the engine hands them over, frozen; a model without buffers needs none, and computes the
        same in eval and train mode)."""
        own = self.payload.get("own", {})
        buffers = {"global": self.payload.get("global_buffers"), "local": own.get("local_buffers"),
                   "task": own.get("task_buffers")}[which]
        out = self._frozen(params, self.x, buffers) if self._frozen is not None else self.apply(params, self.x)
        return tuple(t if t is None else t.detach() for t in out)  # (a stand-in model may give no features)

    def mean(self, per_sample: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None and self.full:  # the same number as below with a mask of ones, in two ops instead of five
            return per_sample.sum() / per_sample.shape[0]
        mask = self.mask if mask is None else mask
        return (per_sample * mask).sum() / mask.sum().clamp(min=1)

    def task_loss_of(self, params, x=None, y=None, mask=None, classes: str = "task") -> torch.Tensor:
        """The task loss of the model with ``params`` on this batch (or on ``x, y, mask``), over ``classes``
        (:meth:`classes`)."""
        x, y, mask = (self.x, self.y, self.mask) if x is None else (x, y, mask)
        _, logits = self.apply(params, x)
        return self.mean(per_sample_task_loss(self.task_loss, only(logits, self.classes(classes)), y), mask)

    def classes(self, which: str = "task") -> torch.Tensor | None:
        """[C] 1/0: the output columns a classification term is over, or None: every one. On a task stream the
        engine tells each client (``payload["own"]``) its current task's classes, the classes its exemplar memory
        holds samples of and those the federation has met so far: ``task`` is the first two — the classes it
        trains on (with no memory, its task's alone: the class-incremental baselines' cross-entropy over the new
        classes) —, ``seen`` the last (a head grown with every class met), ``all`` every column. Without a task
        stream: every column."""
        own = self.payload.get("own", {})
        if which == "all" or "task_classes" not in own:
            return None
        if which == "seen":
            return own["seen_classes"]
        return torch.maximum(own["task_classes"], own["memory_classes"])


def term_name(term) -> str:
    """A term's name in the reports: its ``name`` attribute, else its class name in snake case (``TaskLoss``:
    ``task_loss``)."""
    name = getattr(term, "name", None)
    return name if isinstance(name, str) else re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", type(term).__name__).lower()


def onehot(y: torch.Tensor, num_classes: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, C] float one-hot labels, the rows of padding samples zero when ``mask`` is given (F.one_hot does not vmap:
    it checks the label range with .item())."""
    hot = (y[:, None] == torch.arange(num_classes, device=y.device)).to(torch.float32)
    return hot if mask is None else hot * mask[:, None]


#: The score of an output column a term leaves out: softmax weight exactly 0, no NaN from 0 * log 0.
UNKNOWN = -1e9


#: Which output columns a continual method's classification term is over (:meth:`LocalContext.classes`).
CE_CLASSES = Literal["task", "seen", "all"]


def only(logits: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``logits`` with the columns outside ``keep`` [C] (1/0; None: keep all) at :data:`UNKNOWN`: they take no part
    in a softmax and receive no gradient."""
    return logits if keep is None else torch.where(keep > 0, logits, UNKNOWN)


def per_sample_task_loss(kind: str, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "ce":
        if is_batchedtensor(logits):  # under vmap nll_loss runs as a slow Python decomposition: the same numbers
            return -logits.log_softmax(-1).gather(-1, y[..., None])[..., 0]
        return F.cross_entropy(logits, y, reduction="none")
    if kind == "hinge":  # Crammer–Singer multiclass hinge; for two classes it is the usual SVM hinge
        true = logits.gather(1, y[:, None])
        margins = (1 + logits - true).clamp(min=0)
        return margins.scatter(1, y[:, None], 0.0).amax(1)
    raise ValueError(f"unknown task loss {kind!r}")


@dataclass(frozen=True)
class TaskLoss:
    """The supervised loss (cross-entropy, or hinge for the linear SVM) of the model in ``slot``, over the output
    columns ``classes`` (:meth:`LocalContext.classes`; without a task stream, all of them)."""

    slot: str | tuple[str, ...] = "model"
    classes: str = "task"

    def __call__(self, ctx: LocalContext) -> torch.Tensor:
        _, logits = ctx.forward(self.slot)
        return ctx.mean(per_sample_task_loss(ctx.task_loss, only(logits, ctx.classes(self.classes)), ctx.y))
