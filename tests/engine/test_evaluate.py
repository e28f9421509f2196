"""Evaluation of many personal models on their own ragged splits, and continual evaluation at a fixed number of
predictions however many classes have been seen."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from fedtest import train, with_overrides

from fedmosaic.engine import evaluate as ev
from fedmosaic.engine.evaluate import personal_correct
from fedmosaic.runs.records import TIMING_KEYS, read_metrics
from fedmosaic.runs.runner import run
from fedmosaic.setup.world import build_federation


@pytest.mark.parametrize("vectorize", [True, False])
def test_personal_correct_counts_each_clients_own_model_on_its_own_split(vectorize):
    """Power-law sizes (one large split, many small, one empty), chunked by a small budget: every client's count
    equals its own linear model's hits on exactly its own samples."""
    g = torch.Generator().manual_seed(0)
    sizes = np.array([50, 3, 0, 7, 1, 12, 2, 30])
    ptr = np.concatenate([[0], np.cumsum(sizes)])
    x = torch.randn(int(ptr[-1]), 4, generator=g)
    y = torch.randint(0, 3, (int(ptr[-1]),), generator=g)
    W = torch.randn(len(sizes), 3, 4, generator=g)
    apply = lambda p, xb: (xb, xb @ p["w"].T)  # noqa: E731
    clients = np.array([7, 0, 2, 5, 1, 3, 6, 4])
    got = personal_correct(apply, {"w": W[clients]}, x, y, ptr, clients, lambda t: t, lambda z, lg: lg, vectorize,
                           budget=60)
    want = [int((x[ptr[k] : ptr[k + 1]] @ W[k].T).argmax(1).eq(y[ptr[k] : ptr[k + 1]]).sum()) for k in clients]
    assert got.tolist() == want


# ---- continual evaluation at a fixed number of predictions -------------------------------------------------------
def labels_of(sizes):
    """Class labels with these class sizes, shuffled (as a test set holds them)."""
    y = np.repeat(np.arange(len(sizes)), sizes)
    return y[np.random.default_rng(0).permutation(len(y))]


def test_class_ranks_order_each_class_at_random_by_the_seed():
    y = labels_of([5, 9, 1, 7])
    r = ev.class_ranks(y, seed=3)
    for c, n in enumerate([5, 9, 1, 7]):
        assert sorted(r[y == c]) == list(range(n))  # a permutation within every class
    assert (ev.class_ranks(y, seed=3) == r).all() and (ev.class_ranks(y, seed=4) != r).any()


def test_within_budget_every_model_judges_every_sample():
    y = labels_of([10, 10, 10])
    rows = np.flatnonzero(y < 2)
    assert (ev.deal(y, ev.class_ranks(y, 0), rows, 4, 80) == rows).all()
    assert ev.deal(y, ev.class_ranks(y, 0), rows, 4, None).shape == (4, 20)


def test_beyond_budget_each_model_judges_a_stratified_share_and_the_samples_are_nested():
    sizes = [100, 60, 100, 40]
    y = labels_of(sizes)
    ranks = ev.class_ranks(y, 0)
    rows = np.flatnonzero(y < 4)
    dealt = ev.deal(y, ranks, rows, 5, 125)  # 5 models x 25 of 300 samples
    assert dealt.shape == (5, 25) and len(np.unique(dealt)) == 125  # disjoint shares
    for share in dealt:  # each share in proportion to the class sizes (25 * 100 / 300 = 8.3 of class 0 ...)
        assert np.abs(np.bincount(y[share], minlength=4) - 25 * np.array(sizes) / 300).max() <= 1
        assert (ranks[share] < np.array(sizes)[y[share]] * 125 / 300 + 1).all()  # the first by rank of each class
    assert (ev.deal(y, ranks, rows, 5, 125) == dealt).all()  # deterministic
    # a class met earlier keeps a prefix (by rank) of its judged samples as more classes come
    earlier = ev.deal(y, ranks, np.flatnonzero(y < 2), 5, 125)
    assert set(dealt.ravel()[y[dealt.ravel()] == 0]) <= set(earlier.ravel()[y[earlier.ravel()] == 0])
    # more predictions than samples: every sample judged, by floor or ceil(n * m / N) models
    wrapped = ev.deal(y, ranks, rows, 4, 4 * 100)
    assert set(np.bincount(wrapped.ravel(), minlength=len(y))[rows]) == {1, 2}


def test_judged_class_accuracy_is_the_mean_over_judged_samples_of_their_judges_share():
    y = np.array([0, 0, 1, 1, 2])
    rows = np.array([[0, 1, 2], [0, 3, 2]])
    hits = np.array([[True, False, True], [False, True, False]])
    # sample 0: 1 of 2 judges, sample 1: 0 of 1; class 0: (0.5 + 0) / 2; class 1: (0.5 + 1) / 2; class 2: none
    got = ev.judged_class_accuracy(rows, hits, y, 3)
    assert got[:2].tolist() == [0.25, 0.75] and np.isnan(got[2])


@pytest.mark.parametrize("vectorize", [True, False])
def test_judged_correct_runs_each_model_on_its_own_samples(vectorize):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 4, generator=g), torch.randint(0, 3, (40,), generator=g)
    W = torch.randn(3, 3, 4, generator=g)
    rows = torch.as_tensor(np.random.default_rng(1).integers(0, 40, (3, 17)))
    apply = lambda p, xb: (xb, xb @ p["w"].T)  # noqa: E731
    got = ev.judged_correct(apply, {"w": W}, x, y, rows, lambda t: t, vectorize, batch=10)  # chunks of 3 x 3
    want = torch.stack([(x[r] @ w.T).argmax(1) == y[r] for w, r in zip(W, rows, strict=True)])
    assert torch.equal(got, want)


def continual_cfg(algorithm: str, **eval_over):
    """Four digits clients (sklearn's 8x8 digits), five tasks of two classes, one round each."""
    return with_overrides({
        "seed": 5,
        "data": {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"},
                 "tasks": {"n_tasks": 5, "rounds_per_task": 1}},
        "model": {"name": "mlp", "options": {"hidden": 16}},
        "algorithm": {"name": algorithm},
        "train": {"rounds": 5, "clients_per_round": 4, "batch_size": 16, "optimizer": {"lr": 0.05}},
        "eval": {"client_test": False, **eval_over},
        "checkpoint_every": 1,
    })


def continual_fed(algorithm: str):
    """``continual_cfg`` after the second task."""
    return train(continual_cfg(algorithm), None, rounds=2)


def with_budget(fed, budget):
    s = fed.settings
    fed.world.settings = replace(s, eval=s.eval.model_copy(update={"continual_sample": budget}))
    return fed._continual(1)


@pytest.mark.parametrize("algorithm", ["local", "fedavg"])
def test_a_continual_evaluation_whose_budget_covers_every_prediction_is_the_full_one(algorithm):
    fed = continual_fed(algorithm)
    full = with_budget(fed, None)
    n = 1 if fed.algo.global_model else fed.num_clients
    seen = int(np.isin(fed.fd.y_global, np.flatnonzero(fed.seen_classes(1))).sum())
    assert with_budget(fed, n * seen) == full and "sample" not in full
    assert with_budget(fed, n * seen - 1) != full  # one prediction less: sampled


@pytest.mark.cpu
def test_a_sampled_continual_evaluation_judges_the_dealt_samples_with_each_clients_own_model():
    """Every client's own model on every seen sample, by hand; the sampled evaluation must be these hits at the
    dealt (model, sample) pairs, each class weighted by its test size."""
    fed = continual_fed("local")
    budget = 4 * 30
    out = with_budget(fed, budget)
    g, (x, y) = fed.groups[0], fed.global_test
    labels, first = fed.fd.y_global, fed.first_met(1)
    seen = np.flatnonzero(first[labels] <= 1)
    rows = ev.deal(labels, ev.class_ranks(labels, 5), seen, 4, budget)
    params, _ = fed.predictors(g, 1)
    with torch.no_grad():
        hits = np.stack([(g.apply({k: v[i] for k, v in params.items()}, x)[1]
                          .masked_fill(torch.as_tensor(first > 1), float("-inf")).argmax(1) == y).numpy()[rows[i]]
                         for i in range(4)])
    acc = ev.judged_class_accuracy(rows, hits, labels, fed.fd.num_classes)
    size = np.bincount(labels)
    want = [float(np.nansum(size[m] * acc[m]) / size[m].sum()) for m in (first == 0, first == 1, first <= 1)]
    assert out["tasks"] + [out["seen_acc"]] == pytest.approx(want, abs=1e-12)
    assert out["sample"] == {"models": 4, "per_model": 30, "samples": 120, "of": len(seen)}


def test_a_sampled_continual_evaluation_resumed_equals_uninterrupted(tmp_path):
    cfg = continual_cfg("local", continual_sample=40)
    run(cfg, tmp_path / "full", progress=False)
    run(cfg, tmp_path / "cut", progress=False, stop_after=2)
    run(cfg, tmp_path / "cut", progress=False, resume=True)
    full = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(tmp_path / "full")]
    cut = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(tmp_path / "cut")]
    assert cut == full and full[-1]["continual"]["sample"]["per_model"] == 10


# ---- eval.split: val — choosing hyper-parameters without the test data ------------------------------------------------
@pytest.mark.cpu
def test_eval_split_val_judges_the_clients_pooled_validation_splits_not_the_test_split():
    raw = {"seed": 1, "data": {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"}, "client_val": 0.2,
                               "tasks": {"n_tasks": 2, "rounds_per_task": 1}},
           "model": {"name": "mlp", "options": {"hidden": 8}}, "algorithm": {"name": "fedlwf"},
           "train": {"rounds": 2, "clients_per_round": 4, "batch_size": 16}, "eval": {"split": "val"}}
    fed = build_federation(with_overrides(raw))
    fed.round(0)
    out = fed.evaluate(0)
    x, y = fed.split["val"].x, fed.split["val"].y
    assert torch.equal(fed.global_test[1], y) and len(y) < len(fed.fd.y_global)
    model = fed.groups[0].module
    with torch.no_grad():
        pred = torch.func.functional_call(model, fed.algo.global_params(fed.server), (fed.transform(x),)).argmax(1)
    assert out["global"]["acc"] == pytest.approx(float((pred == y).float().mean()))
    seen = np.isin(y.numpy(), np.flatnonzero(fed.first_met(0) == 0))  # continual: the first task's classes
    first = fed.first_met(0) > 0
    masked = torch.func.functional_call(model, fed.algo.global_params(fed.server), (fed.transform(x[seen]),))
    masked[:, torch.as_tensor(first)] = float("-inf")
    assert out["continual"]["seen_acc"] == pytest.approx(float((masked.argmax(1) == y[seen]).float().mean()))


def test_eval_split_val_without_validation_splits_is_refused_in_one_line():
    from fedmosaic.config import load_config
    from fedmosaic.errors import ConfigError
    with pytest.raises(ConfigError, match="eval.split: 'val' evaluates on the clients' validation splits.*client_val"):
        load_config(None, ["eval.split=val"])
