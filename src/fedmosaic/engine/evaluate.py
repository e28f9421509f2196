"""Evaluation: the global model on the global test set and on every client's test split (one pass over the
concatenated splits, reduced per client), and personalized models on their own client's split (mapped over clients)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..protocol.tree import tmap
from .mapping import for_each_client
from .seeding import CONTINUAL_EVAL, rng

EVAL_BATCH = 4096  # bounds activation memory for CNNs (32x28x28 floats per sample after conv1)
#: a convolutional model on the CPU's channels-last path is judged this many samples at a time (:func:`judging`)
NHWC_BATCH = 128


def judging(transform, channels_last: bool) -> tuple:
    """How a group's models are judged: (the inputs' transform, samples per batch; None: each function's own).
    Models whose clients train on the CPU's channels-last path (``Execution.channels_last``: convolutions) are
    judged in that memory order — the kernels they trained with — and 128 samples at a time, whose activations
    stay in cache: 2.6x faster on one thread than 4,096 images in NCHW order (the CIFAR CNN), with predictions
    that do not depend on the batch size."""
    if not channels_last:
        return transform, None

    def nhwc(x):
        x = transform(x)
        return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x

    return nhwc, NHWC_BATCH


def client_summary(correct_per_client: np.ndarray, sizes: np.ndarray) -> dict:
    """Over the clients with test data: the sample-weighted mean accuracy (``acc``: all their test samples pooled),
    the unweighted mean over clients, its std, and the means of the worst and the best 10% of clients."""
    has = sizes > 0
    if not has.any():
        return {}
    acc = np.sort(correct_per_client[has] / sizes[has])
    tenth = max(1, int(np.ceil(0.1 * len(acc))))
    return {
        "acc": float(correct_per_client[has].sum() / sizes[has].sum()),
        "acc_mean": float(acc.mean()),
        "acc_std": float(acc.std()),
        "acc_worst10": float(acc[:tenth].mean()),
        "acc_best10": float(acc[-tenth:].mean()),
        "clients": int(has.sum()),
    }


@torch.no_grad()
def score_samples(apply, params, x: torch.Tensor, y: torch.Tensor, transform, logits_fn, with_loss: bool = True,
                  batch: int | None = None):
    """Per-sample correctness (and cross-entropy, if asked) of one model over a set of samples, in batches."""
    correct, losses, batch = [], [], batch or EVAL_BATCH
    for lo in range(0, len(y), batch):
        xb, yb = transform(x[lo : lo + batch]), y[lo : lo + batch]
        z, logits = apply(params, xb)
        correct.append(logits_fn(z, logits).argmax(1) == yb)
        if with_loss:
            losses.append(F.cross_entropy(logits, yb, reduction="none"))
    if not correct:
        return torch.zeros(0, dtype=torch.bool, device=y.device), torch.zeros(0, device=y.device)
    return torch.cat(correct), torch.cat(losses) if with_loss else None


def global_metrics(correct: torch.Tensor, losses: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict:
    per_class_n = torch.bincount(y, minlength=num_classes).double()
    # (index_add_, not bincount(weights=...): the latter has no deterministic CUDA kernel)
    per_class_ok = torch.zeros(num_classes, dtype=torch.float64, device=y.device).index_add_(0, y, correct.double())
    return {
        "acc": float(correct.double().mean()),
        "loss": float(losses.mean()),
        # a class the split has no sample of has no accuracy (None), not 0: FedNTD's F averages the classes judged
        "class_acc": [a if n else None for a, n in zip((per_class_ok / per_class_n.clamp(min=1)).tolist(),
                                                      per_class_n.tolist(), strict=True)],
    }


def per_client_correct(correct: torch.Tensor, ptr: np.ndarray) -> np.ndarray:
    c = np.concatenate([[0], np.cumsum(correct.cpu().numpy().astype(np.int64))])
    return (c[ptr[1:]] - c[ptr[:-1]]).astype(np.float64)


@torch.no_grad()
def personal_correct(apply, stacked_params, x, y, ptr, clients: np.ndarray, transform, logits_fn,
                     vectorize: bool, budget: int = 16384, batch: int | None = None) -> np.ndarray:
    """Correct predictions of client k's own model on client k's split, for every k in ``clients`` (each model
    on its whole split at once, or ``batch`` samples at a time)."""
    sizes = np.diff(ptr)[clients]
    out = np.zeros(len(clients))
    if len(y) == 0:
        return out

    each = transform if batch else (lambda t: t)  # batched: each batch transformed as it is judged

    def count(params, xb, yb, mb):
        step, hits = batch or len(yb), yb.new_zeros(())
        for lo in range(0, len(yb), step):
            if batch and not mb[lo]:  # (batched, one client at a time) the rest is padding: real samples come first
                break
            z, logits = apply(params, each(xb[lo : lo + step]))
            hits = hits + ((logits_fn(z, logits).argmax(1) == yb[lo : lo + step]) & mb[lo : lo + step]).sum()
        return hits

    mapped = for_each_client(count, (0, 0, 0, 0), vectorize)
    # clients from the largest split down, each chunk padded to its own largest: with power-law sizes (one client of
    # 500 test samples, most of 7) padding every client to the largest split computed 70x the real samples
    order = np.argsort(-sizes, kind="stable")
    lo = 0
    while lo < len(clients):
        T = max(int(sizes[order[lo]]), 1)
        idx = order[lo : lo + max(1, budget // T)]
        lo += len(idx)
        rows = ptr[clients[idx], None] + np.arange(T)
        mask = np.arange(T) < sizes[idx, None]
        rows = torch.as_tensor(np.where(mask, rows, 0), device=x.device)
        params = tmap(lambda t: t[torch.as_tensor(idx, device=t.device)], stacked_params)
        xs = x[rows] if batch else transform(x[rows])
        out[idx] = mapped(params, xs, y[rows], torch.as_tensor(mask, device=x.device)).cpu().numpy()
    return out


@torch.no_grad()
def stacked_correct(apply, stacked_params, x, y, transform, vectorize: bool, batch: int = EVAL_BATCH,
                    logits_fn=None) -> torch.Tensor:
    """[n, N]: whether each of a stack of n models predicts each of one shared set of samples right (in batches of
    ``batch``: several models at once under vmap, a CNN's activations are per model)."""

    def hits(params):
        out = []
        for lo in range(0, len(y), batch):
            z, logits = apply(params, transform(x[lo : lo + batch]))
            out.append((logits if logits_fn is None else logits_fn(z, logits)).argmax(1) == y[lo : lo + batch])
        return torch.cat(out)

    return for_each_client(hits, (0,), vectorize)(stacked_params)


# ---- continual evaluation: a fixed number of predictions, however many classes have been seen ----------------
def class_ranks(y: np.ndarray, seed: int) -> np.ndarray:
    """Per sample its rank within its class in a seeded random order (fixed for a run and a data seed, so the same
    for every evaluation and method)."""
    order = np.lexsort((rng(seed, CONTINUAL_EVAL).permutation(len(y)), y))  # by class, then at random
    starts = np.concatenate([[0], np.cumsum(np.bincount(y))])
    ranks = np.empty(len(y), dtype=np.int64)
    ranks[order] = np.arange(len(y)) - starts[y[order]]
    return ranks


def deal(y: np.ndarray, ranks: np.ndarray, rows: np.ndarray, n: int, budget: int | None) -> np.ndarray:
    """[n, m]: the samples (of ``rows``) each of ``n`` models judges, ``budget`` predictions at most (None: no limit).

    Within budget every model judges every sample. Beyond it each judges ``m = budget // n``: the samples are put in
    a class-stratified order (each class's samples by ``ranks``, the classes interleaved in proportion to their
    sizes) and dealt to the models in consecutive blocks, wrapping around when ``n * m`` exceeds them; so every
    model judges a stratified share, the samples judged are a stratified sample (all of them when ``n * m`` covers
    them) and, as classes accumulate, each class's judged samples are a prefix of the same order."""
    N = len(rows)
    if budget is None or n * N <= budget:
        return np.tile(rows, (n, 1))
    m = max(1, budget // n)
    size = np.bincount(y[rows])[y[rows]]
    order = rows[np.lexsort((y[rows], (ranks[rows] + 0.5) / size))]
    return order[(np.arange(n)[:, None] * m + np.arange(m)) % N]


@torch.no_grad()
def judged_correct(apply, stacked_params, x, y, rows: torch.Tensor, transform, vectorize: bool, logits_fn=None,
                   batch: int | None = None) -> torch.Tensor:
    """[n, m]: whether model i predicts sample ``rows[i, j]`` right (every model its own samples), ``batch``
    samples a model at a time (default: ``EVAL_BATCH`` in all; a CNN's activations are per model)."""
    batch = batch * len(rows) if batch else EVAL_BATCH

    def hits(params, xb, yb):
        z, logits = apply(params, transform(xb))
        return (logits if logits_fn is None else logits_fn(z, logits)).argmax(1) == yb

    mapped = for_each_client(hits, (0, 0, 0), vectorize)
    return torch.cat([mapped(stacked_params, x[r], y[r]) for r in rows.split(max(1, batch // len(rows)), 1)], 1)


def judged_class_accuracy(rows: np.ndarray, hits: np.ndarray, y: np.ndarray, num_classes: int) -> np.ndarray:
    """[C] per class the mean over its judged samples of the share of their judges that were right (NaN: none
    judged); ``rows``/``hits`` as :func:`deal` and :func:`judged_correct` give them."""
    judges = np.bincount(rows.ravel(), minlength=len(y))
    right = np.bincount(rows.ravel(), hits.ravel().astype(np.float64), len(y))
    judged = judges > 0
    total = np.bincount(y[judged], right[judged] / judges[judged], num_classes)
    count = np.bincount(y[judged], minlength=num_classes)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def local_class_accuracy(apply, stacked_params, x, y, num_classes: int, transform, vectorize: bool,
                         batch: int | None = None) -> torch.Tensor:
    """Per-class accuracy [n, C] of each of a stack of (local) models on one shared test set."""
    ok = stacked_correct(apply, stacked_params, x, y, transform, vectorize, batch or EVAL_BATCH).to(torch.float32)
    onehot = (y[:, None] == torch.arange(num_classes, device=y.device)).to(ok.dtype)
    return ok @ onehot / torch.bincount(y, minlength=num_classes).clamp(min=1)


def in_out_local(class_acc: torch.Tensor, label_counts: np.ndarray) -> tuple[float, float]:
    """FedNTD's in-local / out-local accuracy of local models: class accuracy weighted by the client's label
    distribution p_k, and by (1 - p_k)/(C - 1); averaged over the clients."""
    p = torch.as_tensor(label_counts / np.maximum(label_counts.sum(1, keepdims=True), 1), dtype=class_acc.dtype,
                        device=class_acc.device)
    C = class_acc.shape[1]
    return float((class_acc * p).sum(1).mean()), float((class_acc * (1 - p)).sum(1).mean() / (C - 1))


CROSS_BATCH = 512  # several models at once (vmap) on one batch: a CNN's activations are per model


def cross_correct(apply, stacked_params, x, y, ptr, transform, logits_fn, vectorize: bool,
                  batch: int | None = None) -> np.ndarray:
    """[n, K]: correct predictions of each of a stack of n models on every client's split (rows ``ptr``)."""
    ok = stacked_correct(apply, stacked_params, x, y, transform, vectorize, batch or CROSS_BATCH, logits_fn)
    ok = ok.cpu().numpy().astype(np.int64)
    c = np.concatenate([np.zeros((len(ok), 1), dtype=np.int64), ok.cumsum(1)], 1)
    return (c[:, ptr[1:]] - c[:, ptr[:-1]]).astype(np.float64)


def cross_summary(correct: np.ndarray, sizes: np.ndarray, among: np.ndarray | None = None) -> dict:
    """The K x K accuracy matrix (row i: client i's model, column j: client j's test split), per client its
    intra-domain (own split) and inter-domain (mean over the other clients' splits) accuracy, and their means.

    ``among``: the clients the summary is of (a boolean mask; all by default): inter-domain accuracy over their
    splits, means over them (held-out clients are summarized apart). A client with no other tested split among
    them has no inter-domain accuracy (None, out of the mean; the mean None when no client has one)."""
    acc = correct / np.maximum(sizes, 1)[None, :]
    K = len(acc)
    among = np.ones(K, dtype=bool) if among is None else np.asarray(among, dtype=bool)
    intra = np.diag(acc)
    has = sizes > 0
    others = (has & among)[None, :] & ~np.eye(K, dtype=bool)
    judged = others.sum(1) > 0
    inter = (acc * others).sum(1) / np.maximum(others.sum(1), 1)
    rows = among & judged
    return {"matrix": acc.tolist(), "intra": intra.tolist(),
            "inter": [float(v) if ok else None for v, ok in zip(inter, judged, strict=True)],
            "intra_avg": float(intra[has & among].mean()) if (has & among).any() else None,
            "inter_avg": float(inter[rows].mean()) if rows.any() else None}
