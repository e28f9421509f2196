"""Settings that would be accepted and then ignored, or fail only once the run has started (issue 20, items 5-7):
each is refused in one line before anything is written, or warned in one line where the run still means something.

One row per hostile case, run through the real CLI entry point in-process: the config's changes, the exit status,
and a needle the one error line (or one warning line) must hold; None: no warning at all.
"""

from __future__ import annotations

import copy

import pytest
import yaml
from test_recovery import cli, error_line

BASE = {
    "name": "hostile", "seed": 1,
    "data": {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"}, "client_test": 0.25},
    "model": {"name": "mlp", "options": {"hidden": 8}},
    "train": {"rounds": 2, "clients_per_round": 2, "batch_size": 32, "optimizer": {"lr": 0.05}},
}
TASKS = {"n_tasks": 2, "rounds_per_task": 1}  # digits: two tasks of five classes
NOISE = {"source": "noise", "size": 16}
HETERO = [{"name": "mlp", "options": {"hidden": 8}}, {"name": "mlp", "options": {"hidden": [12, 12]}}]
DELETE = object()

CASES = [
    # ---- 5: weight sharing on mixed architectures
    ("fedweit-hetero", {"algorithm": {"name": "fedweit"}, "data.tasks": TASKS, "model.heterogeneous": HETERO}, 2,
     "model.heterogeneous: algorithm 'fedweit' averages part of its clients' weights"),
    # ---- 6: accepted, then ignored or without effect
    ("memory-total-below-a-task", {"data.tasks": {**TASKS, "memory": {"total": 1}}}, 2,
     "data.tasks.memory.total: 1 shared by the 5 classes of a task keeps 0 samples of each"),
    ("algorithm-memory-total-below-a-task", {"data.tasks": TASKS, "algorithm": {"name": "fedavg", "memory": {
        "total": 4}}}, 2, "algorithm.memory.total of fedavg: 4 shared by the 5 classes"),
    ("memory-runs-dry-before-the-last-task", {"data.tasks": {"n_tasks": 5, "rounds_per_task": 1, "memory": {
        "total": 4}}, "train.rounds": 5}, 0, "the memory is empty from task 4 of 5 on"),
    ("rounds-per-task-beyond-the-run", {"data.tasks": {**TASKS, "rounds_per_task": 5}}, 2,
     "data.tasks.rounds_per_task: a task of 5 rounds never ends within train.rounds = 2"),
    ("cross-clients-without-client-test-splits", {"algorithm": {"name": "ditto"}, "eval": {"cross_clients": True},
                                                  "data.client_test": DELETE}, 2,
     "eval.cross_clients: the clients have no test splits"),
    ("cross-clients-of-one-client", {"algorithm": {"name": "ditto"}, "eval": {"cross_clients": True},
                                     "data.clients": 1, "train.clients_per_round": 1}, 2,
     "eval.cross_clients: one client has no other client's split"),
    ("cross-clients-with-client-test-off", {"algorithm": {"name": "ditto"},
                                            "eval": {"cross_clients": True, "client_test": False}}, 2,
     "eval.cross_clients: the matrix is measured on the clients' test splits"),
    *[(f"{name}-without-tasks", {"algorithm": {"name": name}, "data.public": NOISE}, 2,
       f"data.tasks: algorithm {name!r} learns a stream of class-incremental tasks")
      for name in ("fedlwf", "fedewc", "protofcl", "glfc", "fedweit", "cfed")],
    ("personalized-without-client-test-splits", {"algorithm": {"name": "ditto"}, "data.client_test": DELETE}, 0,
     "data.client_test: 'ditto' is personalized, but the clients have no test splits"),
    ("public-stream-nobody-uses", {"data.public": NOISE}, 0,
     "data.public: no algorithm of this run uses a public stream ('fedavg')"),
    ("public-stream-no-compared-algorithm-uses", {"data.public": NOISE, "compare": [
        {"name": "fedavg"}, {"name": "fedprox", "mu": 0.1}]}, 0, "data.public: no algorithm of this run uses"),
    ("algorithm-beside-compare", {"algorithm": {"name": "fedprox", "mu": 0.5}, "compare": [
        {"name": "fedavg"}, {"name": "fedprox", "mu": 0.1}]}, 2,
     "algorithm: fedprox(mu=0.5) would not run: beside compare: only its entries run; to run it alone add --set "
     "compare=null"),
    ("unquoted-yaml-boolean-key", {"algorithm": {"name": "fedavg", False: 0.01}}, 2,
     "algorithm: the key False is not text (YAML reads off, on, yes and no as booleans: quote the key"),
    # a comparison is refused before its first variant runs
    ("compare-entry-without-tasks", {"compare": [{"name": "fedavg"}, {"name": "fedlwf"}]}, 2,
     "data.tasks: algorithm 'fedlwf'"),
    ("compare-entry-memory-below-a-task", {"data.tasks": TASKS, "compare": [
        {"name": "fedavg"}, {"name": "fedavg", "memory": {"total": 1}}]}, 2,
     "algorithm.memory.total of fedavg: 1 shared by the 5 classes"),  # known from the partition only
    ("compare-entry-without-personal-models", {"eval": {"cross_clients": True}, "compare": [
        {"name": "ditto"}, {"name": "fedavg"}]}, 2, "eval.cross_clients: 'fedavg' has no per-client models"),
    # ---- 7: refused up front rather than inside round 0
    ("cfed-without-public-stream", {"algorithm": {"name": "cfed"}, "data.tasks": TASKS}, 2,
     "data.public: algorithm 'cfed' trains on a public stream: set data.public"),
    ("warm-up-of-a-billion-epochs", {"algorithm": {"name": "local"}, "train.warmup_epochs": 10**9}, 2,
     "the local batch plan of the warm-up (4 clients x 9,000,000,000 steps x batch 32; train.warmup_epochs"),
    ("pfedsrb-w-steps-at-the-limit", {"algorithm": {"name": "pfedsrb", "w_steps": 2**31 - 1}}, 2,
     "(2 clients x 2,147,483,647 steps x batch 32; algorithm.w_steps"),
    # the top-level algorithm of a comparison does not run: no fedavg to refuse on mixed architectures; the
    # public stream one entry uses is no warning either
    ("hetero-compare-without-algorithm", {"model.heterogeneous": HETERO, "data.public": NOISE, "compare": [
        {"name": "fedmd"}, {"name": "local"}]}, 0, None),
    # settings the chosen optimizer, rule or attack does not read (a review found each accepted and ignored)
    ("adam-with-momentum", {"train.optimizer": {"name": "adam", "lr": 0.01, "momentum": 0.9}}, 2,
     "train.optimizer: momentum: name 'adam' does not use it (used by 'sgd'); remove it"),
    ("sgd-with-betas", {"train.optimizer": {"lr": 0.01, "betas": [0.5, 0.9]}}, 2,
     "betas: name 'sgd' does not use it (used by 'adam')"),
    ("median-with-a-clip", {"aggregation": {"rule": "median", "clip": 5.0}}, 2,
     "aggregation: clip: rule 'median' does not use it (used by 'norm_bound')"),
    ("avgm-with-beta2", {"aggregation": {"optimizer": "avgm", "beta2": 0.9}}, 2,
     "aggregation: beta2: optimizer 'avgm' does not use it (used by 'adam', 'yogi')"),
    ("noise-attack-with-a-factor", {"attack": {"kind": "noise", "factor": 5.0}}, 2,
     "attack: factor: kind 'noise' does not use it (used by 'scale', 'sign_flip')"),
    ("defaults-written-out-are-no-setting", {"train.optimizer": {"name": "adam", "lr": 0.01, "momentum": 0.0,
                                                                 "betas": [0.9, 0.999]}}, 0, None),
]


def _config(changes: dict) -> dict:
    cfg = copy.deepcopy(BASE)
    for key, value in changes.items():
        node = cfg
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    return cfg


@pytest.mark.parametrize("changes, code, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_hostile_config_is_refused_or_warned_in_one_line(changes, code, needle, tmp_path):
    path, runs = tmp_path / "cfg.yaml", tmp_path / "runs"
    path.write_text(yaml.safe_dump(_config(changes)))
    rc, err = cli("run", str(path), "--no-progress", "--runs-dir", str(runs))
    warned = [ln for ln in err.splitlines() if ln.startswith("fedmosaic: warning: ")]
    assert rc == code, err
    if code:
        assert needle in error_line(err), err
        assert not runs.exists() or not any(runs.iterdir()), "a refused config wrote a run directory"
    elif needle is None:
        assert not warned, err
    else:
        assert any(needle in ln for ln in warned) and "\n" not in needle, err


@pytest.mark.parametrize("changes, needle", [
    ({"model.name": "mpl"}, "model.name: unknown 'mpl'"),
    ({"model.heterogeneous": [HETERO[0], {"name": "resnet99"}], "algorithm": {"name": "fedmd"}, "data.public": NOISE},
     "model.heterogeneous.1.name: unknown 'resnet99'"),
])
def test_check_refuses_an_unknown_model_as_the_run_would(changes, needle, tmp_path):
    """``run --check`` said "ok" for a config whose run stops at once on its model's name."""
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(_config(changes)))
    rc, err = cli("run", str(path), "--check")
    assert rc == 2 and needle in error_line(err), err


def test_a_public_stream_one_variant_uses_is_no_warning_when_the_comparison_is_reported_or_resumed(tmp_path):
    """A variant's config.yaml keeps the comparison's data.public although that variant alone never uses it."""
    path, out = tmp_path / "cfg.yaml", tmp_path / "cmp"
    path.write_text(yaml.safe_dump(_config({"model.heterogeneous": HETERO, "data.public": NOISE,
                                            "compare": [{"name": "fedmd"}, {"name": "local"}]})))
    assert cli("run", str(path), "--no-progress", "--out", str(out)) == (0, "")
    for argv in (("report", str(out)), ("run", "--no-progress", "--resume", str(out))):
        rc, err = cli(*argv)
        assert rc == 0 and "warning" not in err, err


def test_compared_entries_whose_directory_names_would_be_one_get_their_own(tmp_path):
    """hidden: 8 and hidden: [8] are two labels but one directory name: the comparison used to train the first,
    then stop on 'already exists' for the second, for ever. They are numbered as identical entries are."""
    from fedmosaic.config import dir_name, load_config

    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({
        "name": "coll", "data": {"dataset": "digits", "clients": 4}, "model": {"name": "mlp"},
        "train": {"clients_per_round": 2},
        "compare": [{"name": "fedkd", "mentor": "mlp", "mentor_options": {"hidden": 8}},
                    {"name": "fedkd", "mentor": "mlp", "mentor_options": {"hidden": [8]}}, {"name": "fedavg"},
                    {"name": "fedavg"}]}))
    names = [v.name for v in load_config(p).variants()]
    assert names[0].endswith("#1") and names[1].endswith("#2") and names[2:] == ["fedavg#1", "fedavg#2"]
    assert len({dir_name(n) for n in names}) == 4
