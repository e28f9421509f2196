"""FedALA (Zhang et al. 2023): adaptive local aggregation of the global model into each client's local model.

A client keeps its local model w_loc and, for the top ``p`` parameter tensors (``p: 0``: all of them), element-wise
weights A in [0, 1] (ones at first, persistent). On receiving w_glob it first learns A on a random ``sample``
fraction of its train data with plain projected SGD at rate ``eta``, A ← clip(A − eta ∇_A L(mix), 0, 1), where

    mix = w_loc + (w_glob − w_loc) ⊙ A   for the top p tensors,   w_glob   for the others,

then starts its local training from mix, uploads the trained model and keeps it as w_loc (its personal model, the
one evaluated). As in the authors' ALA.py (TsingZ0/FedALA, system/utils/ALA.py):

- a client's first training round has w_loc = w_glob, so ∇_A = 0: A stays 1 and mix = w_glob (the authors skip the
  step there; here it is a pass that moves nothing);
- the start phase: at the first aggregation where w_loc differs from w_glob (the client's second training round),
  A is trained pass after pass over the same batches until the (population) std of the last ``window`` pass
  losses falls below ``threshold``, each pass recording the loss of its last batch, after more than ``window``
  passes (or after ``max_start_passes``: the authors have no cap); every later round takes one pass. Leaving the
  start phase out is not harmless: on MNIST Dir(0.1) (pfedsrb-mnist-dir0.1) it takes 11-12 passes, after which
  elements of A lie up to 0.97 from where one pass leaves them (mean A of the head's bias 0.38 against 0.79).

Differences from the authors' code (docs/design.md, "Deviations"): only the round's cohort runs ALA (theirs: every
client, every round, also those not selected for training), so a client's start phase comes at its second
training round; the sample is a uniform random subset of ceil(sample · n) samples, batched in a shuffled order fixed
for the round (theirs: a contiguous window of int(sample · n) samples at a random offset of the client's stored,
once-shuffled data, batched in stored order); the personal model evaluated is the client's last trained model (they
evaluate, at the start of every round, each client's mix after that round's ALA, before training).
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import LocalContext
from ..protocol.program import Phase, Step, View


class FedALAConfig(AlgoConfig):
    p: int = Field(2, ge=0, le=10_000, description="parameter tensors, counted from the output, that are mixed; "
                                                   "0: all (the authors' layer_idx = 0, Python's params[-0:])")
    eta: float = Field(1.0, gt=0, description="learning rate of the aggregation weights A")
    sample: float = Field(0.8, gt=0, le=1, description="fraction of the train split A is learned on (each round)")
    threshold: float = Field(0.1, gt=0, description="start phase: A is trained until the std of the last "
                                                    "`window` pass losses is below this")
    window: int = Field(10, ge=2, le=1000, description="pass losses the start phase's std is taken over")
    max_start_passes: int = Field(100, ge=1, le=10_000, description="cap on the start phase's passes")


@register_algorithm
class FedALA(Algorithm):
    name = "fedala"
    Config = FedALAConfig
    personalized = True

    def _top(self, model: dict) -> list[str]:
        names = list(model)
        return names[-self.cfg.p:] if self.cfg.p else names  # (names[-p:] is all of them once p >= len)

    def init_client(self, init_params):
        dev = next(iter(init_params.values())).device
        # seen: rounds trained, capped at 2 (0: w_loc is w_glob; 1: this round's ALA is the start phase)
        return {"local": {k: v.clone() for k, v in init_params.items()},
                "A": {k: torch.ones_like(init_params[k]) for k in self._top(init_params)},
                "seen": torch.zeros((), device=dev)}

    def _mix(self, A: dict, local: dict, glob: dict) -> dict:
        return {k: local[k] + (g - local[k]) * A[k] if k in A else g for k, g in glob.items()}

    def _local(self, state, payload) -> dict:
        return {k: torch.where(state["seen"] > 0, v, payload["global"][k]) for k, v in state["local"].items()}

    def local_init(self, payload, state):
        return {"model": payload["global"], "A": state["A"]}

    def ala_loss(self, ctx: LocalContext) -> torch.Tensor:
        return ctx.task_loss_of(self._mix(ctx.params["A"], self._local(ctx.state, ctx.payload), ctx.payload["global"]))

    def converged(self, losses, params, state, payload):
        """Done with A for this round: always, except in the start phase until the pass losses settle."""
        start = state["seen"] == 1
        w = self.cfg.window
        if losses.shape[0] <= w:  # the authors' len(losses) > num_pre_loss
            return ~start
        return ~start | (losses[-w:].std(correction=0) < self.cfg.threshold)

    def start_from_mix(self, params, state, payload):
        return {**params, "model": self._mix(params["A"], self._local(state, payload), payload["global"])}, state

    def program(self, round_idx):
        ala = Step(("A",), self.ala_loss, lr=self.cfg.eta, clamp=(0.0, 1.0), plain=True)
        return [Phase(epochs=1, view=View("sample", self.cfg.sample), updates=(ala,), after=self.start_from_mix,
                      key=1, until=self.converged, max_repeats=self.cfg.max_start_passes - 1),
                Phase(updates=(Step(("model",)),), key=0)]

    def finish(self, params, state, payload, stats):
        return {"model": params["model"]}, {"local": params["model"], "A": params["A"],
                                            "seen": torch.clamp(state["seen"] + 1, max=2)}

    def personal_params(self, state, payload):
        return {k: torch.where(state["seen"] > 0, v, payload["global"][k]) for k, v in state["local"].items()}
