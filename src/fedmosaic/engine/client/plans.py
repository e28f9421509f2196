"""Batch plans: which samples each client's step of a phase draws, fixed by the seed, the round, the client and the
phase — never by how the cohort is run (its order, chunking, packing, or the machine)."""

from __future__ import annotations

import numpy as np
import torch

from ...protocol.program import Phase, View
from ..seeding import VIEWS, batch_plan, rng
from ..tensors import ClientTensors
from . import augment
from .augment import AugmentConfig

#: The "client" whose batch order every client follows on the public stream (beyond any real client id).
SHARED = 2**40


def view_offsets(view: View, n: int, seed: int, client: int, round_idx: int) -> np.ndarray:
    """The offsets (inside the client's train range) of the samples ``view`` selects for ``client``."""
    if view.part == "all":
        return np.arange(n)
    cut = min(n, int(np.ceil(view.frac * n)))
    if view.part == "sample":
        return np.sort(rng(seed, VIEWS, 1, round_idx, client).choice(n, size=cut, replace=False))
    order = rng(seed, VIEWS, 0, client).permutation(n)
    return np.sort(order[:cut] if view.part == "support" else order[cut:])


def plan_phase(data: ClientTensors, clients: np.ndarray, phase: Phase, p: int, seed: int, round_idx: int, keys: tuple,
               batch: int, epochs: int, augment_cfg: AugmentConfig | None, work: np.ndarray | None = None) -> dict:
    """The batches of ``phase`` (its ``p``-th of the round) for ``clients``, of ``batch`` samples for ``epochs``
    epochs unless the phase says otherwise: device tensors, step-major (a step's slice is contiguous: torch.compile guards
    on strides): ``rows``/``mask`` [S, n, B], augmentation ``draws``, the paired batch's ``rows2``/``mask2``,
    and per client ``steps`` and ``per_epoch`` (numpy). ``work``: per client the share of its steps it runs
    (``participation.stragglers``: the first ceil(share x steps), at least one; the batches are the full plan's)."""
    dev = data.x.device
    public = phase.view.part == "public"
    base = None  # the samples each client may draw from (a subset of its rows: the current task), or all
    if public:  # one stream for everybody: the same samples in the same order for every client
        sizes, start = np.full(len(clients), len(data.y)), np.zeros(len(clients), dtype=np.int64)
    else:
        base, sizes, start = data.available(clients), data.counts(clients), data.ptr[clients]
    k = p if phase.key is None else phase.key
    keys = keys + ((k,) if k else ())  # schedule 0 (the first phase by default) is the single-phase order

    def rows_of(view, extra, steps, batch=batch):
        offs = None if view.part in ("all", "public") else [view_offsets(view, int(n), seed, int(k), round_idx)
                                                            for n, k in zip(sizes, clients, strict=True)]
        counts = sizes if offs is None else np.array([len(o) for o in offs], dtype=np.int64)
        who = np.full(len(clients), SHARED) if public else clients
        pos, valid, st = batch_plan(counts, who, epochs, batch, seed, round_idx, keys + extra, steps)
        if offs is not None:
            for i, o in enumerate(offs):
                pos[i] = o[pos[i]] if len(o) else 0
        if base is not None:
            for i, b in enumerate(base):
                pos[i] = b[pos[i]] if len(b) else 0
        # a padded (masked) position reads the client's first row — or, for an empty client whose rows start at
        # the end of the data, the last row there is: never an index out of bounds
        pad = np.minimum(start, max(len(data.y) - 1, 0))[:, None, None]
        rows = np.where(valid, start[:, None, None] + pos, pad).transpose(1, 0, 2).copy()
        mask = valid.transpose(1, 0, 2).copy()
        return (torch.as_tensor(rows, device=dev), torch.as_tensor(mask, dtype=torch.float32, device=dev),
                st, -(-counts // batch))

    if phase.pair is not None and phase.pair.part == "next":  # batches of 2B, halved: D and D' never overlap
        rows, mask, steps, per_epoch = rows_of(phase.view, (), phase.steps, 2 * batch)
        plan = {"rows": rows[..., :batch].contiguous(), "mask": mask[..., :batch].contiguous(),
                "rows2": rows[..., batch:].contiguous(), "mask2": mask[..., batch:].contiguous()}
    else:
        rows, mask, steps, per_epoch = rows_of(phase.view, (), phase.steps)
        plan = {"rows": rows, "mask": mask}
    if work is not None:  # stragglers stop early: their later steps masked, as a smaller client's are padded
        steps = np.where((work < 1) & (steps > 0), np.maximum(1, np.ceil(work * steps)), steps).astype(np.int64)
        S = int(steps.max(initial=0))
        live = torch.as_tensor(np.arange(S)[:, None] < steps[None, :], device=dev)[..., None]
        # (a probe measures the client's data as the phase defines it, however early its training stopped)
        uncut = {"rows": plan["rows"], "mask": plan["mask"]}
        plan = {k: v[:S] * live if k.startswith("mask") else v[:S] for k, v in plan.items()}
        plan["uncut"] = uncut
    # (``clients`` and ``forward``: what seeds the random draws of a model's forward pass, per client: FORWARD)
    plan.update(steps=steps, per_epoch=per_epoch, batch=batch, clients=np.asarray(clients),
                forward=(seed, round_idx, keys))
    if phase.pair is not None and phase.pair.part != "next":
        rows2, mask2, *_ = rows_of(phase.pair, (1,), steps)
        short = len(rows) - len(rows2)  # clients with nothing to pair with (e.g. no query samples) take none
        plan["rows2"] = torch.cat([rows2, rows[:short]]) if short else rows2
        plan["mask2"] = torch.cat([mask2, torch.zeros_like(mask[:short])]) if short else mask2
    if augment_cfg is not None and not public:  # (the public stream is not augmented)
        plan["draws"] = augment.draw(augment_cfg, clients, steps, batch, data.x.shape[1:], seed, round_idx,
                                     keys).to(dev)
    return plan
