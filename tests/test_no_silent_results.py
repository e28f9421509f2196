"""A result is what was asked for, or an error (issue 20): a comparison runs the algorithm it names, a checkpoint
resumes only its own run, a damaged metrics line anywhere in a record is dropped (never crashes report or resume),
a start that was killed while claiming its directory can be started again, and "resume" is said only where there
is something to resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_recovery import SMALL, cli, error_line, metrics, reference, write_cfg  # noqa: F401 (a fixture)

from fedmosaic.config import load_config
from fedmosaic.runs.records import read_metrics
from fedmosaic.runs.runner import run


# ---- 1: compare --algorithms X runs X ------------------------------------------------------------------------
def test_compare_with_one_algorithm_runs_that_algorithm(tmp_path):
    out = tmp_path / "one"
    rc, err = cli("compare", str(write_cfg(tmp_path)), "--algorithms", "fedprox:mu=0.5", "--no-progress",
                  "--out", str(out))
    assert rc == 0, err
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["algorithm"] == {"name": "fedprox", "memory": None, "mu": 0.5} and saved["name"] == "fedprox(mu=0.5)"
    assert json.loads((out / "comparison.json").read_text())[0]["algorithm"] == "fedprox"
    # and it is FedProx's result, not the config's FedAvg
    other = tmp_path / "fedavg"
    assert cli("run", str(write_cfg(tmp_path)), "--no-progress", "--out", str(other))[0] == 0
    assert metrics(out)[-1]["train_loss"] != metrics(other)[-1]["train_loss"]


# ---- 2: a checkpoint identifies its run completely -----------------------------------------------------------
def test_a_checkpoint_of_another_algorithm_with_the_same_seed_and_partition_is_set_aside(tmp_path, reference):
    out = tmp_path / "cut"
    run(load_config(write_cfg(tmp_path)), out, progress=False, stop_after=2)
    other = tmp_path / "other"  # same seed, partition and tensor layout; another algorithm
    run(load_config(write_cfg(tmp_path, algorithm={"name": "fedprox", "mu": 0.5})), other, progress=False,
        stop_after=2)
    (out / "checkpoints" / "round_00002.pt").write_bytes((other / "checkpoints" / "round_00002.pt").read_bytes())
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0 and "written by another run (algorithm, its hyper-parameters or model differ)" in err
    assert (out / "checkpoints" / "round_00002.pt.corrupt").exists()
    assert metrics(out) == reference


def test_an_amended_learning_rate_or_more_rounds_keep_the_checkpoints_usable(tmp_path):
    out = tmp_path / "cut"
    run(load_config(write_cfg(tmp_path)), out, progress=False, stop_after=1)
    rc, err = cli("run", "--no-progress", "--resume", str(out), "--amend", "--set", "train.rounds=5",
                  "--set", "train.optimizer.lr=0.01", "--set", "eval.every=2")
    assert rc == 0 and "set aside" not in err and "starting again" not in err
    assert [r["lr"] for r in read_metrics(out)] == [0.05, 0.05, 0.01, 0.01, 0.01]


# ---- 3: a start killed while claiming its directory ----------------------------------------------------------
def test_a_directory_whose_claim_never_finished_is_reclaimed(tmp_path, reference):
    out = tmp_path / "r"
    out.mkdir()
    (out / ".config.yaml.k3j2_x9q.tmp").write_text("name: sma")  # what a kill during the claim leaves
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 2 and "never finished starting" in error_line(err) and "--out" in error_line(err)
    rc, err = cli("run", str(write_cfg(tmp_path)), "--no-progress", "--out", str(out))
    assert rc == 0, err
    assert metrics(out) == reference and not list(out.glob(".*.tmp"))


def _comparison(tmp_path, **changes) -> Path:
    return write_cfg(tmp_path, compare=[{"name": "fedavg"}, {"name": "fedprox", "mu": 0.5}], **changes)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """The two-variant comparison, uninterrupted: per variant its metrics."""
    tmp = tmp_path_factory.mktemp("cmp")
    out = tmp / "full"
    assert cli("run", str(_comparison(tmp)), "--no-progress", "--out", str(out))[0] == 0
    return {d.name: metrics(d) for d in out.iterdir() if (d / "config.yaml").exists()}


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["claim killed", "config.yaml lost", "never started"])
def test_a_comparison_resumes_a_variant_that_lost_or_never_wrote_its_config(damage, tmp_path, compared):
    cfg = load_config(_comparison(tmp_path))
    out = tmp_path / "cmp"
    from fedmosaic.reports.compare import run_all

    run_all(cfg, out, progress=False)
    second = out / "fedprox_mu=0.5"
    if damage == "config.yaml lost":
        (second / "config.yaml").unlink()
        for ck in sorted((second / "checkpoints").glob("*.pt"))[:-1]:
            ck.unlink()
    else:  # the variant switch: the first variant finished, the second was killed while claiming (or before)
        for p in list(second.rglob("*"))[::-1]:
            p.unlink() if p.is_file() else p.rmdir()
        if damage == "claim killed":
            (second / ".config.yaml.abc123de.tmp").write_text("")
    (out / ".comparison.json.zz9_0a1b.tmp").write_text("[")  # a table whose writing was killed
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0, err
    assert ("config.yaml is missing; restored from the comparison's config" in err) == (damage == "config.yaml lost")
    assert {d.name: metrics(d) for d in out.iterdir() if (d / "config.yaml").exists()} == compared
    assert not list(out.rglob(".*.tmp"))  # 9: no temporary file is left behind


def test_a_variant_that_lost_its_config_and_its_meta_is_refused_with_nothing_written(tmp_path):
    """Its config.yaml was restored from the comparison's, and then the run refused it for want of a meta.json:
    the restored file stayed behind. Now it is refused in one line first."""
    from fedmosaic.reports.compare import run_all

    out = tmp_path / "cmp"
    run_all(load_config(_comparison(tmp_path)), out, progress=False)
    second = out / "fedprox_mu=0.5"
    (second / "config.yaml").unlink()
    (second / "meta.json").unlink()
    before = sorted(p.name for p in second.iterdir())
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 2 and "holds neither config.yaml nor meta.json" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in second.iterdir()) == before


def test_report_names_the_variants_of_a_comparison_that_have_no_run(tmp_path, capsys):
    out = tmp_path / "cmp"
    cfg = load_config(_comparison(tmp_path))
    from fedmosaic.reports.compare import dir_name

    first = cfg.variants()[0]
    (out / dir_name(first.name)).parent.mkdir(parents=True)
    (out / "comparison.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    run(first, out / dir_name(first.name), progress=False)
    rc, err = cli("report", str(out))
    assert rc == 0 and "1 of its 2 variants have no run yet" in err and "fedprox_mu=0.5" in err
    (out / "comparison.yaml").write_text("{")  # damaged: it stopped the report; the runs are whole
    rc, err = cli("report", str(out))
    assert rc == 0 and "comparison.yaml: invalid YAML" in err and "the table shows the runs found in" in err, err


# ---- 4: every part of a metrics record is checked on read -----------------------------------------------------
CONTINUAL = {**SMALL, "data": {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"},
                                "tasks": {"n_tasks": 2, "rounds_per_task": 2}},
             "eval": {"client_test": False}, "train": {**SMALL["train"], "rounds": 4}}
PERSONAL = {**SMALL, "algorithm": {"name": "ditto"}, "eval": {"cross_clients": True}}


def _damage(rec: dict, part: str, how) -> None:
    node = rec
    *path, last = [int(p) if p.isdigit() else p for p in part.split(".")]
    for p in path:
        node = node[p]
    if how is del_:
        del node[last]
    else:
        node[last] = how


del_ = object()


@pytest.mark.slow
@pytest.mark.parametrize("base, part, how", [
    (CONTINUAL, "continual", "x"),
    (CONTINUAL, "continual.tasks", [0.5, 0.5, 0.5, 0.5, 0.5]),  # more tasks than stages
    (CONTINUAL, "continual.tasks", "0.5"),
    (CONTINUAL, "continual.seen_acc", None),
    (CONTINUAL, "continual.task_end", 1),
    (CONTINUAL, "continual.stage", 7),
    (PERSONAL, "personal.acc_std", "high"),
    (PERSONAL, "personal", []),
    (PERSONAL, "cross.matrix", [[1.0]]),
    (PERSONAL, "cross.matrix.0", "row"),
    (PERSONAL, "cross.intra_avg", del_),
    (PERSONAL, "cross.names", [1, 2, 3, 4]),
    (SMALL, "global.class_acc", [0.1]),
    (SMALL, "global_clients.acc_worst10", None),
    (SMALL, "time_round_s", "slow"),
])
def test_a_metrics_record_damaged_in_any_part_is_dropped_and_recomputed(base, part, how, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(base))
    full, out = tmp_path / "full", tmp_path / "cut"
    assert cli("run", str(cfg), "--no-progress", "--out", str(full))[0] == 0
    run(load_config(cfg), out, progress=False, stop_after=2)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[1])
    _damage(rec, part, how)
    (out / "metrics.jsonl").write_text("\n".join([lines[0], json.dumps(rec), *lines[2:]]) + "\n")
    rc, err = cli("report", str(out))
    assert rc == 0 and "line 2 is damaged" in err, err
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0 and "line 2 is damaged" in err
    assert metrics(out) == metrics(full)


# ---- 7: "resume" only where a round was saved ------------------------------------------------------------------
def test_a_run_that_fails_before_its_first_round_leaves_nothing_and_does_not_say_resume(tmp_path):
    out = tmp_path / "r"
    rc, err = cli("run", str(write_cfg(tmp_path, train__optimizer__lr=1e30)), "--no-progress", "--out", str(out))
    line = error_line(err)
    assert rc == 2 and "non-finite" in line and "--resume" not in line
    assert "no round had finished, nothing was kept; run it again with --set train.optimizer.lr=" in line
    assert not out.exists()
