"""The deployment tests' configs: digits over 3 clients (one SuperNode each), the sequential backend, and one
algorithm per family with the settings it needs."""

from __future__ import annotations

from fedtest import PROTOCOL_CASES, merged

from fedmosaic.config import validate

DIGITS3 = {
    "name": "deployed",
    "seed": 1,
    "data": {"dataset": "digits", "clients": 3, "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_size": 5},
             "client_test": 0.25},
    "model": {"name": "mlp", "options": {"hidden": 16}},
    "train": {"rounds": 2, "clients_per_round": 3, "batch_size": 16, "optimizer": {"lr": 0.05}},
    "engine": {"backend": "sequential"},
    "checkpoint_every": 1,
}
#: one algorithm per family: a global model; personalized (state on the node, personal evaluation); model-
#: heterogeneous (two architectures, logits on public noise first, a warm-up); continual (tasks, memory, end_task)
FAMILIES = {
    "fedavg": {"algorithm": {"name": "fedavg"}},
    "ditto": {"algorithm": {"name": "ditto"}},
    "ahf": {"algorithm": {"name": "ahf"}, "data": {"public": {"source": "noise", "size": 16}},
            "model": {"heterogeneous": [{"name": "mlp", "options": {"hidden": 8}},
                                        {"name": "mlp", "options": {"hidden": [12, 12]}}]},
            "train": {"warmup_epochs": 1, "optimizer": {"name": "adam", "lr": 0.01}}},
    "protofcl": {"algorithm": {"name": "protofcl"},
                 "data": {"partition": {"scheme": "iid"}, "client_test": 0.0,
                          "tasks": {"n_tasks": 3, "classes_per_task": 3, "rounds_per_task": 1,
                                    "memory": {"per_class": 2}}},
                 "eval": {"client_test": False}},
}


#: the protocol's test set (``fedtest.PROTOCOL_CASES``: one algorithm per family and engine mechanism) over 3 clients
PROTOCOL = {algo["name"]: merged(merged(over, {"algorithm": algo}), {"data": {"clients": 3},
                                                                       "train": {"clients_per_round": 3}})
            for algo, over in PROTOCOL_CASES}


def config(family: str = "fedavg", **over):
    """The validated config of ``family`` (or of an algorithm of ``PROTOCOL``) with nested overrides
    (``{"train": {"rounds": 3}}`` style)."""
    raw = merged(DIGITS3, FAMILIES.get(family) or PROTOCOL[family])
    for key, value in over.items():
        raw = merged(raw, {key: value})
    return validate(raw)


def same_metrics(a: list[dict], b: list[dict], tol: float = 1e-5) -> list[str]:
    """Where two runs' metrics differ (beyond ``tol``), leaving out timings and a deployment's notes."""
    diffs = []

    def walk(x, y, at):
        if isinstance(x, dict) and isinstance(y, dict):
            for k in set(x) | set(y):
                if k.startswith("time_") or k in ("deploy", "deploy_eval"):
                    continue
                if k not in x or k not in y:
                    diffs.append(f"{at}.{k}: only in one")
                else:
                    walk(x[k], y[k], f"{at}.{k}")
        elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{at}[{i}]")
        elif isinstance(x, float) and isinstance(y, float):
            if not abs(x - y) <= tol * max(1.0, abs(y)):
                diffs.append(f"{at}: {x} vs {y}")
        elif x != y:
            diffs.append(f"{at}: {x!r} vs {y!r}")

    if len(a) != len(b):
        return [f"{len(a)} vs {len(b)} rounds"]
    for i, (x, y) in enumerate(zip(a, b)):
        walk(x, y, f"round {i}")
    return diffs
