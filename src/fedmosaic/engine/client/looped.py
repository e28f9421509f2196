"""The looped path of the step runner: the clients still active, one after another, each for all its remaining
steps with plain autograd and in-place updates of its rows of the stacked parameters (what the sequential backend
does for every step, and the vectorized one once few clients are left)."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch.nn.utils.stateless import _reparametrize_module

from ...protocol.tree import tmap
from .. import stopping
from ..seeding import forward_seed

#: Looped clients' batches are gathered this many steps at a time.
LOOP_BLOCK = 64

#: ``loop_below`` of the sequential path: every step is looped.
LOOP_ALWAYS = 2**62


def draws_random(module: torch.nn.Module) -> bool:
    """The model has dropout layers (active in training): vmap cannot draw their masks per client; the loop draws
    them seeded per client and step (``LoopedSteps._forward_draws``)."""
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules())


class LoopUpdate(NamedTuple):
    """One update of a looped client: the trees its objective sees, their autograd leaves, the leaves the update
    writes (views of the stacked parameters), its optimiser state (views too) and its objective."""

    tree: dict
    live: list
    flat: list
    opt: dict
    objective: object


class LoopRow(NamedTuple):
    """A looped client: its payload (with ``own``), state, buffers, and per update a :class:`LoopUpdate`."""

    payload: dict
    state: dict
    buffers: dict
    updates: list


class LoopedSteps:
    """The looped step runner of :class:`~.local.LocalTrainer` (a part of it)."""

    def _loop_rows(self, packed, real, steps, updates, payload) -> list:
        """For each of the first ``real`` clients of ``packed``: its payload, state and buffers, and per update of
        ``steps`` the trees its objective sees, their autograd leaves, the leaves to update (views of the stacked
        parameters: updates land in them) and its optimiser state (views too). Made once per packing."""
        rows = []
        for j in range(real):
            p, o, st, b, own = tmap(lambda t, j=j: t[j], packed)
            per = [LoopUpdate(*self._live(p, u.slots), o[updates.index(u)], u.objective or self.algo.loss)
                   for u in steps]
            rows.append(LoopRow({**payload, "own": own}, st, b, per))
        return rows

    def _loop_rest(self, data, tensors, s, s0, packed, real, left, steps, updates, payload, lr, who=None):
        """Every remaining step (``left[j]`` from step ``s`` on) of the first ``real`` clients of ``packed``,
        client after client — its parameters stay in cache, its batches are gathered ``LOOP_BLOCK`` steps at a
        time —, with plain autograd and in-place updates of its rows. Returns per client the sums of the first
        update's losses and of its accumulated stats over those steps, and that loss at its last step.
        ``who``: (the plan's ``forward`` key, the clients' ids): a model that draws random numbers in its forward
        pass (dropout) draws them from a generator seeded per client and step (``seeding.forward_seed``), so its
        run is reproducible, resumable and the same on any pool; the process's own generator is left as it was."""
        losses, accs, lasts = [], [], []
        for j, row in enumerate(self._loop_rows(packed, real, steps, updates, payload)):
            with self._bound_to(row[3]), self._forward_draws(who, j, s, data.x.device):
                ls, acs = self._loop_client(data, tensors, s, s0, j, int(left[j]), row, steps, lr)
            losses.append(torch.stack(ls).sum())
            lasts.append(ls[-1])
            accs.append(tmap(lambda *ts: torch.stack(ts).sum(0), *acs) if acs[0] else {})
        return (torch.stack(losses), (tmap(lambda *ts: torch.stack(ts), *accs) if accs[0] else {}),
                torch.stack(lasts))

    def _loop_client(self, data, tensors, s, s0, j, left, row, steps, lr):
        """The ``left`` steps from step ``s`` of packed client ``j``: its losses and stats of the first update."""
        payload, st, b, per = row
        ls, acs = [], []
        for lo in range(0, left, LOOP_BLOCK):
            hi = min(left, lo + LOOP_BLOCK)
            x, y, m, pair = self._batch(data, tensors, (slice(s - s0 + lo, s - s0 + hi), j))
            # a batch's real samples come first: a partial batch is cut to them instead of computing padding
            cut, full = self._cuts(m, x.shape[1])
            cut2 = self._cuts(pair[2], pair[0].shape[1])[0] if pair else None
            for k in range(hi - lo):
                stopping.check()  # a signal's grace is over: stop at this step, the round unfinished
                xk, yk, mk = (x[k], y[k], m[k]) if cut[k] is None else (x[k, : cut[k]], y[k, : cut[k]],
                                                                          m[k, : cut[k]])
                pk = tuple(t[k] if cut2[k] is None else t[k, : cut2[k]] for t in pair)
                if self.channels_last:
                    xk, pk = self._nhwc(xk), tuple(self._nhwc(t) if i == 0 else t for i, t in enumerate(pk))
                for i, (u, (tree, live, flat, opt, objective)) in enumerate(zip(steps, per, strict=True)):
                    grads, loss, acc = self._scaled(
                        lambda: self._autograd(tree, live, st, payload, xk, yk, mk, pk, b, objective, i == 0, full[k]),
                        payload["own"], b)
                    self._update(u, flat, grads, opt, lr, s + lo + k)
                    if i == 0:
                        ls.append(loss)
                        acs.append(acc)
        return ls, acs

    @contextlib.contextmanager
    def _forward_draws(self, who, j: int, s: int, device: torch.device):
        """Every looped client's steps under torch's generator forked and seeded for it: any random op of its
        forward pass (dropout layers, functional dropout, ...) draws the same numbers on every run, pool and resume.
        (~20 µs a client and phase on a CPU; the models without such ops draw nothing from it.)"""
        if who is None:
            yield
            return
        (seed, round_idx, keys), clients = who
        cuda = device.type == "cuda"
        with torch.random.fork_rng(devices=[device] if cuda else [], device_type=device.type):
            seeded = forward_seed(seed, round_idx, keys, int(clients[j]), s)
            # (the device's generator itself: torch.manual_seed would take ~0.1 ms, seeding every device)
            index = (torch.cuda.current_device() if device.index is None else device.index) if cuda else None
            (torch.cuda.default_generators[index] if cuda else torch.default_generator).manual_seed(seeded)
            yield

    @contextlib.contextmanager
    def _measuring(self, running_stats: bool = False):
        """Measurements of a model — probes (a Fisher, a gradient, sums), logits on the public stream — with its
        dropout layers off (as an evaluation has them), whatever mode the rest is in: they draw nothing, so they
        are the same on every run, pool and resume. BatchNorm keeps the mode it was given, or with
        ``running_stats`` normalises by its running statistics, as evaluation and prediction do."""
        kinds = (torch.nn.modules.dropout._DropoutNd,) + ((torch.nn.modules.batchnorm._BatchNorm,) * running_stats)
        layers = [m for m in self.module.modules() if isinstance(m, kinds) and m.training]
        for m in layers:
            m.training = False
        try:
            yield
        finally:
            for m in layers:
                m.training = True

    @contextlib.contextmanager
    def _bound_to(self, per):
        """While one looped client trains: its ``model`` tree put in the module once, rather than swapped in and
        out by ``functional_call`` at every step (a sixth of a small model's step). Only for a phase of one update
        (several updates train different trees) of a model without buffers (they are passed along per call)."""
        tree = per[0][0].get("model") if len(per) == 1 and not self._has_buffers else None
        if tree is None:
            yield
            return
        with _reparametrize_module(self.module, tree, tie_weights=self._ties):
            self._bound = tree
            try:
                yield
            finally:
                self._bound = None

    @staticmethod
    def _nhwc(x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x

    def _cuts(self, mask: torch.Tensor, batch: int) -> tuple[list, list]:
        """Per step of ``mask`` [K, B]: the number of real samples when the batch is partial, else None; and
        whether every sample left after the cut is real. Not with buffers: BatchNorm's batch statistics have always
        included the padding rows, and keep doing so."""
        counts = mask.sum(1).to(torch.int64).tolist()
        if self._has_buffers:
            return [None] * len(counts), [c == batch for c in counts]
        return [c if 0 < c < batch else None for c in counts], [c > 0 for c in counts]
