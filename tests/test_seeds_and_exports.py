"""Several seeds (mean ± std, banded curves, report grouping by seed) and the exports researchers' tools read:
metrics.csv, TensorBoard event files, the table as Markdown and LaTeX."""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest
from test_recovery import cli, metrics, write_cfg

import fedmosaic
from fedmosaic.runs.records import read_metrics, scalars

COMPARE = [{"name": "fedavg"}, {"name": "fedprox", "mu": 0.5}]


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """A two-algorithm comparison over seeds 0 and 1, from the command line."""
    tmp = tmp_path_factory.mktemp("seeds")
    out = tmp / "s"
    rc, err = cli("compare", str(write_cfg(tmp, train__rounds=3)), "--algorithms", "fedavg", "fedprox:mu=0.5",
                  "--seeds", "0", "1", "--no-progress", "--out", str(out))
    assert rc == 0, err
    return out


def test_seeds_run_each_in_its_own_directory_and_the_table_is_their_mean_and_std(seeded):
    per_seed = [json.loads((seeded / f"seed_{s}" / "comparison.json").read_text()) for s in (0, 1)]
    top = json.loads((seeded / "comparison.json").read_text())
    assert [s["name"] for s in top] == ["fedavg", "fedprox(mu=0.5)"] and all(s["seeds"] == 2 for s in top)
    for i, agg in enumerate(top):
        vals = [p[i]["global_acc_final"] for p in per_seed]
        assert vals[0] != vals[1]  # two seeds, two partitions: two different results
        assert agg["global_acc_final"] == pytest.approx(np.mean(vals))
        assert agg["global_acc_final_std"] == pytest.approx(np.std(vals, ddof=1))
    for s in (0, 1):  # each seed's runs carry that seed
        assert "seed: %d" % s in (seeded / f"seed_{s}" / "fedavg" / "config.yaml").read_text()
    md = (seeded / "table.md").read_text()
    mean, std = top[0]["global_acc_final"], top[0]["global_acc_final_std"]
    assert f"| fedavg | 2 | 3 | {mean:.2%} ± {std:.2%} |" in md
    tex = (seeded / "table.tex").read_text()
    assert tex.startswith("\\begin{tabular}{l") and "\\toprule" in tex and tex.rstrip().endswith("\\end{tabular}")
    assert f"fedprox(mu=0.5) & 2 & 3 & {top[1]['global_acc_final']:.2%}".replace("%", "\\%") in tex
    assert "$\\pm$" in tex and "\\%" in tex and " % " not in tex
    assert (seeded / "learning_curves.png").stat().st_size > 0


def test_report_groups_runs_that_differ_only_in_the_seed(seeded, tmp_path):
    runs = [seeded / f"seed_{s}" / "fedavg" for s in (0, 1)]
    rc, out = _report(*runs)
    assert rc == 0
    row = next(ln for ln in out.splitlines() if ln.startswith("fedavg"))
    top = json.loads((seeded / "comparison.json").read_text())[0]
    assert f"{top['global_acc_final']:.2%} ± {top['global_acc_final_std']:.2%}" in row
    # the seeds directory itself: both methods, each over its two seeds, no partition warning across seeds
    rc, out = _report(seeded)
    assert rc == 0 and "different partitions" not in out
    rows = [ln for ln in out.splitlines() if ln.startswith(("fedavg ", "fedprox(mu=0.5) ")) and " ± " in ln]
    assert len(rows) == 2 and all(" 2 " in ln for ln in rows)  # one row per method, over 2 seeds


def test_every_round_records_its_cohort_and_report_names_runs_of_one_seed_that_trained_other_clients(
        seeded, tmp_path):
    """A fair comparison trains every method on the same clients each round: the runs show it (``cohort``), and
    ``report`` says from which round two runs of one seed did not (here a hand-edited cohort)."""
    a, b = (read_metrics(seeded / "seed_0" / m) for m in ("fedavg", "fedprox_mu=0.5"))
    assert [r["cohort"] for r in a] == [r["cohort"] for r in b]
    assert all(len(r["cohort"]) == r["clients"] for r in a)
    assert [r["cohort"] for r in a] != [r["cohort"] for r in read_metrics(seeded / "seed_1" / "fedavg")]
    header = (seeded / "seed_0" / "fedavg" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "clients" in header and not [c for c in header if c.startswith("cohort")]  # ids are not a column
    rc, out = _report(seeded / "seed_0")
    assert rc == 0 and "different clients" not in out
    other = tmp_path / "other"
    shutil.copytree(seeded / "seed_0" / "fedprox_mu=0.5", other)
    lines = (other / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[1])
    rec["cohort"] = rec["cohort"][::-1][:1] + [max(rec["cohort"]) + 100]
    (other / "metrics.jsonl").write_text("\n".join([lines[0], json.dumps(rec), *lines[2:]]) + "\n")
    rc, out = _report(seeded / "seed_0" / "fedavg", other)
    assert rc == 0 and "the runs of seed 0 trained different clients from round 1 on" in " ".join(out.split())


def test_runs_that_differ_in_their_learning_rate_are_not_seeds_of_one_method(seeded, tmp_path):
    """A resume may amend the learning rate, so the checkpoints' hash leaves it out; the seeds a table averages
    must not: two runs of different learning rates are two rows, not one mean ± std."""
    other = tmp_path / "lr"
    cfg = write_cfg(tmp_path, train__rounds=3, seed=1, train__optimizer={"lr": 0.5})
    assert cli("run", str(cfg), "--no-progress", "--out", str(other), "--set", "name=fedavg",
               "--set", "compare=[{name: fedavg}]")[0] == 0
    rc, out = _report(seeded / "seed_0" / "fedavg", other)
    assert rc == 0
    assert not [ln for ln in out.splitlines() if " ± " in ln], out  # no row is a mean over the two


def test_seeds_that_stopped_at_different_rounds_are_averaged_at_the_round_both_reached(seeded, tmp_path):
    """A seed still running (or cut short) is not averaged at its round with the others at theirs."""
    short = tmp_path / "short"
    cfg = write_cfg(tmp_path, train__rounds=2, seed=1)
    assert cli("run", str(cfg), "--no-progress", "--out", str(short), "--set", "name=fedavg",
               "--set", "compare=[{name: fedavg}]")[0] == 0
    rc, out = _report(seeded / "seed_0" / "fedavg", short)
    assert rc == 0 and "compared at round 2" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("fedavg"))
    accs = [metrics(d)[1]["global"]["acc"] for d in (seeded / "seed_0" / "fedavg", short)]
    assert f"{np.mean(accs):.2%} ± {np.std(accs, ddof=1):.2%}" in row, row


def test_a_seeds_table_holds_the_seeds_its_config_lists(seeded, tmp_path):
    """A seed taken out with --amend (or a stray seed_* folder) is not averaged in, and report says so."""
    import shutil

    out = tmp_path / "s"
    shutil.copytree(seeded, out)
    rc, err = cli("run", "--no-progress", "--resume", str(out), "--amend", "--set", "seeds=[0]")
    assert rc == 0 and "takes out seed 1: its runs stay" in err, err  # (said when it is done, not only later)
    table = json.loads((out / "comparison.json").read_text())
    assert all(r["global_acc_final"] == json.loads((out / "seed_0" / "comparison.json").read_text())[i]
               ["global_acc_final"] and "global_acc_final_std" not in r for i, r in enumerate(table)), table
    rc, text = _report(out)
    assert rc == 0 and "seed_1 not among the seeds of its seeds.yaml, left out of the table" in text


def test_an_amendment_a_run_would_refuse_leaves_the_saved_configs_as_they_were(seeded, tmp_path):
    """Fewer rounds than are finished: refused in one line, and seeds.yaml (and each comparison.yaml) unchanged,
    so the plain resume still works (it used to find the amended file and refuse everything after)."""
    import shutil

    from test_recovery import error_line

    out = tmp_path / "s"
    shutil.copytree(seeded, out)
    saved = {p: p.read_bytes() for p in out.rglob("*.yaml")}
    rc, err = cli("run", "--no-progress", "--resume", str(out), "--amend", "--set", "train.rounds=2")
    assert rc == 2 and "train.rounds must be >= the 3 rounds already finished" in error_line(err)
    assert {p: p.read_bytes() for p in out.rglob("*.yaml")} == saved
    assert cli("run", "--no-progress", "--resume", str(out))[0] == 0


def test_a_seed_that_lost_its_config_gets_it_back_on_resume(tmp_path):
    """As a comparison's variant does: restored from seeds.yaml with a warning, and the seed's rounds are kept."""
    out = tmp_path / "s"
    assert cli("run", str(write_cfg(tmp_path, train__rounds=2)), "--seeds", "0", "1", "--no-progress",
               "--out", str(out))[0] == 0
    before = metrics(out / "seed_1")
    (out / "seed_1" / "config.yaml").unlink()
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0 and "config.yaml is missing; restored" in err, err
    assert metrics(out / "seed_1") == before


def test_a_seed_that_lost_its_comparison_yaml_gets_it_back_on_resume(seeded, tmp_path):
    import shutil

    out = tmp_path / "s"
    shutil.copytree(seeded, out)
    (out / "seed_1" / "comparison.yaml").unlink()
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0 and "comparison.yaml is missing; restored" in err, err
    for v in ("fedavg", "fedprox_mu=0.5"):
        assert metrics(out / "seed_1" / v) == metrics(seeded / "seed_1" / v)


def test_a_set_that_would_turn_a_comparison_into_one_run_is_refused_by_name(seeded):
    from test_recovery import error_line

    before = {p: p.stat().st_mtime_ns for p in seeded.rglob("*") if p.is_file()}
    rc, err = cli("run", "--no-progress", "--resume", str(seeded / "seed_0"), "--set", "compare=null")
    assert rc == 2 and "holds a comparison (comparison.yaml), not one run" in error_line(err)
    assert {p: p.stat().st_mtime_ns for p in seeded.rglob("*") if p.is_file()} == before


def test_seeds_on_a_single_runs_resume_say_what_the_directory_holds(tmp_path):
    """Not "seeds.yaml not found": the directory holds a single run, which --seeds (or compare:) cannot turn
    into several; nothing in it changes."""
    from test_recovery import error_line

    out = tmp_path / "one"
    assert cli("run", str(write_cfg(tmp_path, train__rounds=1)), "--no-progress", "--out", str(out))[0] == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    for argv, kind in ((["--amend", "--seeds", "1", "2"], "not a seeds run"),
                       (["--seeds", "1"], "not a seeds run"),
                       (["--set", "compare=[{name: fedavg}, {name: local}]"], "not a comparison")):
        rc, err = cli("run", "--no-progress", "--resume", str(out), *argv)
        line = error_line(err)
        assert rc == 2 and f"{out} holds a single run (config.yaml), {kind}" in line
        assert "not found" not in line
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def _report(*dirs):
    import contextlib
    import io

    from fedmosaic.cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(["report", *map(str, dirs)])
    return rc, buf.getvalue()


def test_a_seeds_run_resumes_from_where_it_was_stopped(seeded, tmp_path):
    from fedmosaic.config import load_config
    from fedmosaic.runs.runner import run

    cfg = load_config(seeded / "seeds.yaml")
    out = tmp_path / "s"
    out.mkdir()
    (out / "seeds.yaml").write_text((seeded / "seeds.yaml").read_text())
    # seed 0 finished, seed 1 stopped inside its second variant
    assert cli("run", "--no-progress", "--out", str(out / "seed_0"), str(seeded / "seed_0" / "comparison.yaml"))[0] == 0
    one = cfg.with_seed(1)
    first, second = one.variants()
    (out / "seed_1").mkdir()
    (out / "seed_1" / "comparison.yaml").write_text((seeded / "seed_1" / "comparison.yaml").read_text())
    run(first, out / "seed_1" / "fedavg", progress=False)
    run(second, out / "seed_1" / "fedprox_mu=0.5", progress=False, stop_after=0)
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0, err
    for s in (0, 1):
        for v in ("fedavg", "fedprox_mu=0.5"):
            assert metrics(out / f"seed_{s}" / v) == metrics(seeded / f"seed_{s}" / v)
    mine, ref = (json.loads((d / "comparison.json").read_text()) for d in (out, seeded))
    for a, b in zip(mine, ref, strict=True):
        assert a["global_acc_final"] == b["global_acc_final"] and a["global_acc_final_std"] == b["global_acc_final_std"]


def test_seeds_from_python_give_per_seed_results(tmp_path):
    results = fedmosaic.compare(str(write_cfg(tmp_path, train__rounds=2)), ["fedavg"], tmp_path / "py",
                                seeds=[0, 2], progress=False)
    (r,) = results
    assert [s.config.seed for s in r.seeds] == [0, 2] and r.summary["seeds"] == 2
    assert r.summary["global_acc_final"] == pytest.approx(np.mean([s.summary["global_acc_final"] for s in r.seeds]))


def test_seeds_must_be_distinct(tmp_path):
    rc, err = cli("run", str(write_cfg(tmp_path)), "--seeds", "1", "1", "--no-progress", "--out", str(tmp_path / "x"))
    assert rc == 2 and "seeds: must be distinct seeds" in err and not (tmp_path / "x").exists()


# ---- exports ----------------------------------------------------------------------------------------------------
def test_metrics_csv_holds_every_number_of_metrics_jsonl(tmp_path):
    out = tmp_path / "r"
    assert cli("run", str(write_cfg(tmp_path)), "--no-progress", "--out", str(out))[0] == 0
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    records = read_metrics(out)
    assert len(rows) == len(records) == 4
    for row, rec in zip(rows, records, strict=True):
        flat = scalars(rec)
        assert flat["global.acc"] == rec["global"]["acc"] and "global.class_acc.0" not in flat
        assert {k: float(v) for k, v in row.items() if v != ""} == pytest.approx({k: float(v) for k, v in flat.items()})


def test_tensorboard_event_files_hold_the_rounds_and_a_resume_replaces_the_recomputed_ones(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedmosaic.config import load_config
    from fedmosaic.runs.runner import run

    out = tmp_path / "r"
    cfg = load_config(write_cfg(tmp_path, eval={"tensorboard": True}))
    run(cfg, out, progress=False, stop_after=1)
    (out / "checkpoints" / "round_00001.pt").unlink()  # round 1 is recomputed: its events must not be doubled
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0, err
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    steps = [(e.step, e.value) for e in acc.Scalars("global/acc")]
    want = [(r["round"] + 1, r["global"]["acc"]) for r in read_metrics(out)]
    assert [s for s, _ in steps] == [s for s, _ in want]  # each round once, also those of the resumed part
    assert [v for _, v in steps] == pytest.approx([v for _, v in want])
    assert "train_loss" in acc.Tags()["scalars"]


def test_a_variant_that_diverges_does_not_stop_its_comparison_and_the_table_says_so(tmp_path):
    """A long comparison left running must not lose every later method to one that diverged: the diverged one keeps
    its rounds before, the table and the seeds' table say in which round (or in how many seeds) it diverged."""
    import warnings as w

    from fedmosaic import api
    from fedmosaic.reports.compare import table

    cfg = {"name": "div", "seed": 0, "seeds": [0, 1],
           "data": {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"},
                    "tasks": {"n_tasks": 2, "rounds_per_task": 2}},
           "model": {"name": "mlp", "options": {"hidden": 8}},
           "train": {"rounds": 4, "clients_per_round": 4, "batch_size": 16, "optimizer": {"lr": 0.05}},
           "eval": {"every": 1}, "checkpoint_every": 1}
    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        # FedEWC's penalty starts with the second task: at this weight it diverges there, after rounds 0-1
        results = api.compare(cfg, [{"name": "fedewc", "lam": 1e12}, "fedavg"], out=tmp_path / "c", progress=False)
    assert any("fedewc(lam=1000000000000.0): " in str(c.message) and "the comparison goes on" in str(c.message)
               for c in caught)
    by = {r.name: r for r in results}
    assert by["fedavg"].summary["rounds"] == 4 and "diverged_seeds" not in by["fedavg"].summary
    diverged = by["fedewc(lam=1000000000000.0)"].summary
    assert diverged["diverged_seeds"] == 2 and 2 <= diverged["rounds"] < 4  # its rounds before are kept
    text = table([r.summary for r in results], "markdown")
    assert "seeds diverged" in text
    one = json.loads((tmp_path / "c" / "seed_0" / "comparison.json").read_text())
    assert one[0]["diverged_round"] >= 2 and "diverged_round" not in one[1]
