"""Helpers shared by the engine and algorithm tests."""

from __future__ import annotations

import contextlib
import signal

import torch

from fedmosaic.protocol.tree import leaves
from fedmosaic.setup.world import build_federation

#: The small federation most engine tests train: 8 blob clients, Dirichlet(0.5), an MLP, momentum and weight decay.
BLOBS8 = {
    "seed": 3,
    "data": {"dataset": "blobs", "clients": 8, "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_size": 5},
             "client_test": 0.25},
    "model": {"name": "mlp", "options": {"hidden": 16}},
    "train": {"rounds": 3, "clients_per_round": 5, "local_epochs": 2, "batch_size": 8,
              "optimizer": {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}},
    "checkpoint_every": 2,
}


#: The personalized family's federation: 6 blob clients with 25% test splits, Dirichlet(0.5), a small MLP.
BLOBS6 = {
    "seed": 5,
    "data": {"dataset": "blobs", "clients": 6, "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_size": 5},
             "client_test": 0.25},
    "model": {"name": "mlp", "options": {"hidden": 8}},
    "train": {"rounds": 3, "clients_per_round": 4, "local_epochs": 1, "batch_size": 8, "optimizer": {"lr": 0.05}},
    "checkpoint_every": 2,
}


#: One algorithm of each family and engine mechanism, with the settings it needs over BLOBS6 (a public stream and two
#: architectures; a class-incremental stream on digits): the protocol's test set.
HETERO = {"data": {"public": {"source": "noise", "size": 16}},
          "model": {"heterogeneous": [{"name": "mlp", "options": {"hidden": 8}},
                                      {"name": "mlp", "options": {"hidden": [12, 12]}}]},
          "train": {"warmup_epochs": 1, "optimizer": {"name": "adam", "lr": 0.01}}}
CONTINUAL = {"data": {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"}, "client_test": 0.0,
                      "tasks": {"n_tasks": 5, "rounds_per_task": 1, "memory": {"per_class": 2}}},
             "train": {"clients_per_round": 3, "batch_size": 16}, "eval": {"client_test": False}}
PROTOCOL_CASES = [
    ({"name": "fedavg"}, {}), ({"name": "scaffold"}, {}), ({"name": "fedcurv"}, {}), ({"name": "ditto"}, {}),
    ({"name": "apfl_pd", "z": 1}, {}), ({"name": "pfedsrb"}, {}), ({"name": "fedpac"}, {}), ({"name": "fedkd"}, {}),
    ({"name": "ahf"}, HETERO), ({"name": "fccl"}, HETERO),
    ({"name": "feddf_global"}, {"data": {"public": {"source": "noise", "size": 16}}}),
    ({"name": "protofcl"}, CONTINUAL), ({"name": "fedweit"}, CONTINUAL), ({"name": "glfc"}, CONTINUAL)]


def merged(base: dict, over: dict) -> dict:
    """``base`` with ``over`` merged in, nested dicts key by key (a partition scheme is replaced whole)."""
    out = dict(base)
    for k, v in over.items():
        nested = isinstance(v, dict) and isinstance(base.get(k), dict) and k != "partition"
        out[k] = merged(base[k], v) if nested else v
    return out


def blobs6_partition(blob_data):
    from fedmosaic.data.federated import PartitionSpec, compute

    spec = PartitionSpec("blobs", 6, {"scheme": "dirichlet", "alpha": 0.5, "min_size": 5}, "train", 0.25, 0.0, 5)
    return compute(spec, blob_data)


def blobs8_partition(blob_data, partition: dict | None = None, val: float = 0.0):
    """BLOBS8's partition of ``blob_data`` (or ``partition``, a config's ``data.partition``), ``val`` of each
    client's samples for validation."""
    from fedmosaic.data.federated import PartitionSpec, compute

    spec = PartitionSpec("blobs", 8, partition or BLOBS8["data"]["partition"], "train", 0.25, val, 3)
    return compute(spec, blob_data)


def with_overrides(raw: dict, **over):
    """A validated config from ``raw`` with overrides ``a__b__c=value`` (nested keys joined by ``__``)."""
    from fedmosaic.config import validate

    for key, value in over.items():
        node = raw
        *path, last = key.split("__")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return validate(raw)


def train(cfg, fd, rounds=None):
    """A federation after ``rounds`` rounds (default: the config's)."""
    fed = build_federation(cfg, fd)
    for t in range(rounds or cfg.train.rounds):
        fed.round(t)
    return fed


def assert_trees_close(a, b, exact=False, atol=1e-5, rtol=1e-4):
    """Equal values wherever each tree lives (a wire pool's client states arrive decoded on the host, an
    in-process pool's stay on the run's device)."""
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb) and la
    for x, y in zip(la, lb):
        x, y = x.cpu(), y.cpu()
        if exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


#: a hang guard's limit: far beyond any test's step on a busy machine, so only a real hang reaches it (no test
#: asserts speed)
HANG_S = 120


class TimeLimit(BaseException):
    """Raised by :func:`time_limit`'s alarm: a BaseException, so no ``except Exception`` in the code under test can
    swallow it and a hang fails the test instead of blocking CI."""


@contextlib.contextmanager
def time_limit(seconds: float):
    def fire(signum, frame):
        raise TimeLimit(f"no result within {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
