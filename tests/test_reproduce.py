"""`fedmosaic reproduce`: the claims files, the verdicts on hand-made summaries, and one paper end to end."""

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from fedmosaic.cli.main import main
from fedmosaic.reports.reproduce import ClaimSpec, experiment_config, judge, load_paper, papers
from tests.conftest import SHARED_DATA, need_data


def claim(**kw):
    base = {"id": "c", "text": "t", "source": "Table 1", "experiment": "e", "metric": ["acc"]}
    return ClaimSpec.model_validate({**base, **kw})


def seeds(*rows):
    """One comparison per seed: ``rows`` are {method: accuracy} dicts."""
    return [[{"name": m, "algorithm": m.split("(")[0], "acc": a} for m, a in row.items()] for row in rows]


def test_a_gain_is_paired_per_seed_and_judged_against_the_papers_number():
    runs = seeds({"a": 0.60, "b": 0.50}, {"a": 0.70, "b": 0.62})  # gains 10 and 8 points
    out = judge(claim(kind="gain", method="a", baseline="b", paper=10.0, tolerance=1.5), runs)
    assert out["ours"] == pytest.approx(9.0) and out["std"] == pytest.approx(2 ** 0.5)
    assert out["difference"] == pytest.approx(-1.0) and out["verdict"] == "within tolerance"
    assert judge(claim(kind="gain", method="a", baseline="b", paper=20.0), runs)["verdict"] == "same direction"
    assert judge(claim(kind="gain", method="b", baseline="a", paper=5.0), runs)["verdict"] == "contradicted"
    # lower is better (forgetting): a smaller F is the gain, and a raw metric is not shown in percent
    f = judge(claim(kind="gain", method="a", baseline="b", paper=-0.05, percent=False, lower=True, tolerance=0.01),
              seeds({"a": 0.13, "b": 0.20}))
    assert f["ours"] == pytest.approx(-0.07) and f["verdict"] == "same direction"


def test_value_best_and_order():
    runs = seeds({"a(x=1)": 0.80, "b": 0.70, "c": 0.75})
    assert judge(claim(kind="value", method="a", paper=81.0, tolerance=2), runs)["verdict"] == "within tolerance"
    assert judge(claim(kind="value", method="a", paper=85.0, tolerance=2), runs)["verdict"] == "outside tolerance"
    best = judge(claim(kind="best", method="a", methods=["b", "c"]), runs)
    assert best["verdict"] == "holds" and best["difference"] == pytest.approx(5.0)
    worse = judge(claim(kind="best", method="b", methods=["a", "c"]), runs)
    assert worse["verdict"] == "contradicted" and "a, c" in worse["note"]
    assert judge(claim(kind="order", methods=["a", "c", "b"]), runs)["verdict"] == "holds"
    flip = judge(claim(kind="order", methods=["a", "b", "c"]), runs)
    assert flip["verdict"] == "contradicted" and flip["note"].startswith("b is not above c")
    assert "ours, in the claimed order: a " in flip["note"] and ">" not in flip["note"]  # (no 'b 1.0 > c 2.0')


def test_a_method_or_metric_missing_is_not_run_never_a_verdict():
    out = judge(claim(kind="gain", method="a", baseline="z", paper=1.0), seeds({"a": 0.5, "b": 0.4}))
    assert out["verdict"] == "not run" and "z" in out["why"]
    assert judge(claim(kind="value", method="a", paper=1.0, metric=["other"]), seeds({"a": 0.5}))["verdict"] \
        == "not run"


def test_a_claim_is_judged_on_the_seeds_where_all_its_methods_have_results():
    """A comparison under way (seed 1 has a but not yet b): a gain is paired on seed 0 alone and says so; a value
    of a uses both seeds; a method with a result in no seed is named."""
    runs = seeds({"a": 0.60, "b": 0.50}, {"a": 0.80})
    gain = judge(claim(kind="gain", method="a", baseline="b", paper=10.0, tolerance=1.0), runs)
    assert (gain["ours"], gain["seeds"], gain["of"]) == (pytest.approx(10.0), 1, 2) and gain["std"] is None
    value = judge(claim(kind="value", method="a", paper=70.0, tolerance=1.0), runs)
    assert (value["ours"], value["seeds"], value["of"]) == (pytest.approx(70.0), 2, 2)
    assert judge(claim(kind="best", method="a", methods=["b"]), runs)["seeds"] == 1
    apart = judge(claim(kind="gain", method="a", baseline="b", paper=1.0), seeds({"a": 0.6}, {"b": 0.5}))
    assert apart["verdict"] == "not run" and apart["why"] == "a, b have not finished in the same seed yet"
    none = judge(claim(kind="value", method="c", paper=1.0), runs)
    assert none["verdict"] == "not run" and none["why"] == "c not finished in any seed yet"


def test_a_method_that_diverged_is_named_in_the_claim():
    runs = [[{"name": "a", "algorithm": "a", "acc": 0.3, "diverged_round": 4}, {"name": "b", "algorithm": "b",
                                                                                  "acc": 0.5}],
            [{"name": "a", "algorithm": "a", "acc": 0.6}, {"name": "b", "algorithm": "b", "acc": 0.5}]]
    out = judge(claim(kind="gain", method="a", baseline="b", paper=1.0), runs)
    assert out["seeds"] == 2 and out["diverged"] == "a diverged (round 4) in 1 of 2 seeds: its rounds before count"
    first = [[{"name": "a", "algorithm": "a", "diverged_round": 0}, {"name": "b", "algorithm": "b", "acc": 0.5}]]
    out = judge(claim(kind="gain", method="a", baseline="b", paper=1.0), first)
    assert out["verdict"] == "not run" and out["why"] == "a diverged in its first round in 1 of 1 seeds"


def test_a_seed_left_out_for_a_divergence_or_a_nan_is_named_never_silently_dropped():
    ok = {"a": 0.9, "b": 0.8}
    first = [{"name": "a", "algorithm": "a", "diverged_round": 0}, {"name": "b", "algorithm": "b", "acc": 0.8}]
    out = judge(claim(kind="best", method="a", methods=["b"]), [*seeds(ok, ok), first])
    assert (out["verdict"], out["seeds"], out["of"]) == ("holds", 2, 3)
    assert out["left_out"] == "a diverged in its first round in 1 of 3 seeds (those seeds left out)"
    nan = judge(claim(kind="gain", method="a", baseline="b", paper=10.0), seeds(ok, {"a": float("nan"), "b": 0.8}))
    assert nan["seeds"] == 1 and nan["left_out"].startswith("a has no finite acc in 1 of 2 seeds")
    unfinished = judge(claim(kind="gain", method="a", baseline="b", paper=10.0), seeds(ok, {"a": 0.9}))
    assert unfinished["seeds"] == 1 and "left_out" not in unfinished  # (not judged yet, not lost)


def test_a_verdict_on_the_mean_says_on_how_many_seeds_it_holds():
    """A mean can hold where most seeds do not: best 79, 79, 95 against 80, 80, 80 is the best on the mean only."""
    runs = seeds({"a": 0.79, "b": 0.80}, {"a": 0.79, "b": 0.80}, {"a": 0.95, "b": 0.80})
    best = judge(claim(kind="best", method="a", methods=["b"]), runs)
    assert best["verdict"] == "holds" and best["per_seed"] == "the best on 1 of 3 seeds"
    worse = judge(claim(kind="best", method="b", methods=["a"]), runs)
    assert worse["verdict"] == "contradicted" and worse["note"] == "not above a; next: a 84.33"
    assert worse["per_seed"] == "the best on 2 of 3 seeds"
    gain = judge(claim(kind="gain", method="a", baseline="b", paper=5.0), runs)
    assert gain["verdict"] == "within tolerance" and gain["per_seed"] == "in the claimed direction on 1 of 3 seeds"
    lower = judge(claim(kind="gain", method="a", baseline="b", paper=-1.0, lower=True), runs)
    assert lower["per_seed"] == "in the claimed direction on 2 of 3 seeds"
    order = judge(claim(kind="order", methods=["a", "b"]), runs)
    assert order["verdict"] == "holds" and order["per_seed"] == "the order holds on 1 of 3 seeds"
    assert "per_seed" not in judge(claim(kind="best", method="a", methods=["b"]), runs[2:])  # (one seed: itself)


def test_a_claim_is_refused_without_what_its_kind_needs():
    with pytest.raises(ValueError, match="gain claim needs baseline"):
        claim(kind="gain", method="a", paper=1.0)


@pytest.mark.parametrize("paper", papers())
def test_every_claim_names_an_experiment_that_builds_and_methods_it_runs(paper):
    spec = load_paper(paper)
    for scale in ("cpu", "paper"):
        for name, exp in spec.experiments.items():
            cfg = experiment_config(exp, scale, [], None)
            variants = cfg.variants()
            names = {v.name for v in variants}
            algos = [v.algorithm.name for v in variants]
            for c in (c for c in spec.claims if c.experiment == name):
                for m in filter(None, [c.method, c.baseline, *c.methods]):
                    assert m in names or algos.count(m) == 1, f"{paper} {c.id}: {m} is not one of {sorted(names)}"


def test_the_cifar100_continual_comparison_is_protofcls_reproduction_at_cpu_scale():
    """configs/cil-cifar100-compare.yaml and `reproduce protofcl --scale cpu` are one experiment (issue 33's table
    (a) and the paper's claims): the same config but for the name, the thread count and the variants' order."""
    from fedmosaic.config import dump, load_config

    repro = yaml.safe_load(dump(experiment_config(load_paper("protofcl").experiments["cifar100"], "cpu", [], None)))
    mine = yaml.safe_load(dump(load_config(Path(__file__).parents[1] / "configs" / "cil-cifar100-compare.yaml")))
    for cfg in (repro, mine):
        cfg.pop("name"), cfg["engine"].pop("threads")
        cfg["compare"] = sorted(cfg["compare"], key=json.dumps)
    assert repro == mine


def test_an_unknown_paper_or_claim_is_one_line_and_writes_nothing(tmp_path, capsys):
    assert main(["reproduce", "apfl", "--out", str(tmp_path / "r")]) == 2
    assert main(["reproduce", "apfl-pd", "--claims", "nope", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "papers: " in err[0] and "claims: mnist-gain" in err[1] and len(err) == 2
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_reproduce_apfl_pd_end_to_end_with_a_dataset_missing(tmp_path, capsys):
    """The cheapest paper, every claim, rounds cut: a verdict per claim in reproduction.md and .json; CIFAR-10 is
    left out of the data folder, so its claims are not run, with the reason, and nothing is written for them. The
    same command again resumes: nothing trains twice."""
    for name in ("mnist", "vehicle", "femnist"):
        need_data(name)
    data = tmp_path / "data"
    data.mkdir()
    for name in ("mnist", "vehicle", "femnist"):
        (data / name).symlink_to(Path(SHARED_DATA) / name)
    out = tmp_path / "rep"
    argv = ["reproduce", "apfl-pd", "--seeds", "0", "--set", "train.rounds=1", "--out", str(out), "--data-dir",
            str(data), "--no-progress"]
    assert main(argv) == 0
    report = json.loads((out / "reproduction.json").read_text())
    claims = {c["id"]: c for c in report["claims"]}
    assert set(claims) == {c.id for c in load_paper("apfl-pd").claims}
    for cid, c in claims.items():
        if cid.startswith("cifar10"):
            assert c["verdict"] == "not run" and "cifar10-gray" in c["why"] and "not found" in c["why"]
        else:
            assert c["verdict"] in ("within tolerance", "outside tolerance", "same direction", "contradicted",
                                    "holds"), c
            assert c["seeds"] == 1 and (c["kind"] != "gain" or isinstance(c["ours"], float))
    assert not (out / "cifar10").exists()
    md = (out / "reproduction.md").read_text()
    assert md.count("| mnist-") == 3 and "**not run**: dataset 'cifar10-gray' not found" in md
    # each experiment's command as it is after this call: the ones that ran resume (a fresh `run ... --out` of them
    # was refused: the folder exists), the one that did not start starts
    commands = dict(re.findall(r"^- `(\S+)` \(.*\): `(fedmosaic run .*)`$", md, re.MULTILINE))
    assert commands["mnist"] == f"fedmosaic run --resume {out / 'mnist'}", commands
    assert commands["cifar10"].startswith(
        "fedmosaic run apfl-cifar10 --seeds 0 --set train.rounds=20 --set train.rounds=1")  # (its cpu scale, then ours)
    metrics = sorted(out.rglob("metrics.jsonl"))
    before = [p.stat().st_mtime_ns for p in metrics]
    assert main([*shlex.split(commands["mnist"])[1:], "--data-dir", str(data), "--no-progress"]) == 0
    assert main(argv) == 0
    assert [p.stat().st_mtime_ns for p in metrics] == before
    assert json.loads((out / "reproduction.json").read_text())["claims"] == report["claims"]
    # a copy of it on a machine without the data (or --status there): the finished experiments are judged from
    # their runs as before, not reported as not run for want of a dataset they no longer need
    nodata = tmp_path / "empty"
    nodata.mkdir()
    elsewhere = [*argv[:argv.index("--data-dir") + 1], str(nodata), *argv[argv.index("--data-dir") + 2:]]
    assert main(elsewhere) == 0
    again = json.loads((out / "reproduction.json").read_text())["claims"]
    assert [c for c in again if not c["id"].startswith("cifar10")] == \
        [c for c in report["claims"] if not c["id"].startswith("cifar10")]
    rows = [line for line in md.splitlines() if line.startswith(("| mnist-", "| vehicle-", "| femnist-"))]
    capsys.readouterr()
    assert main([*elsewhere, "--status"]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line in rows] == rows
    assert [p.stat().st_mtime_ns for p in metrics] == before


def test_status_reports_progress_and_judges_only_finished_seeds_writing_nothing(tmp_path, capsys):
    """--status while a reproduction is under way (here: seed 1's FedAvg cut short after its first round): per seed
    the finished methods and the rounds of the one under way, each claim judged on the seeds where its methods
    have finished (the gain over FedAvg on seed 0 alone, APFL-PD against centralized on both), and nothing run or
    written; on a folder with no reproduction, one line."""
    need_data("vehicle")
    out = tmp_path / "rep"
    argv = ["reproduce", "apfl-pd", "--claims", "vehicle-gain", "vehicle-central", "--seeds", "0", "1", "--set",
            "train.rounds=2", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    exp = out / "vehicle"
    cut = next(p.parent for p in (exp / "seed_1").glob("*/summary.json") if p.parent.name.startswith("fedavg"))
    for f in (exp / "comparison.json", exp / "seed_1" / "comparison.json", cut / "summary.json"):
        f.unlink()
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text(lines[0] + "\n")
    capsys.readouterr()
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert main([*argv, "--status"]) == 0
    text = capsys.readouterr().out
    methods = len(list((exp / "seed_0").glob("*/summary.json")))
    assert f"seed 0: {methods} of {methods} methods finished; seed 1: {methods - 1} of {methods} methods " \
           f"finished, " in text and " 1 of 2 rounds" in text
    rows = {line.split(":")[0]: line for line in text.splitlines() if line.startswith("| vehicle-")}
    assert "(1 of 2 seeds)" in rows["| vehicle-gain"] and "(2 seeds)" in rows["| vehicle-central"]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before
    # a finished seed's runs kept without its comparison.json (as docs/runs/ commits them): the same verdict
    verdict = next(line for line in text.splitlines() if line.startswith("| vehicle-gain:"))
    (exp / "seed_0" / "comparison.json").unlink()
    assert main([*argv, "--status"]) == 0
    assert verdict in capsys.readouterr().out.splitlines()
    # ... and its APFL-PD diverged (no summary.json; meta.json says when): its rounds before still count, and the
    # claim says so
    one = next(p.parent for p in (exp / "seed_0").glob("*/summary.json") if p.parent.name.startswith("apfl_pd"))
    (one / "summary.json").unlink()
    meta = json.loads((one / "meta.json").read_text())
    (one / "meta.json").write_text(json.dumps({**meta, "diverged_round": 1}))
    assert main([*argv, "--status"]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("| vehicle-gain:"))
    assert row == verdict.removesuffix(" |") + ": apfl_pd diverged (round 1) in 1 of 1 seeds: its rounds before " \
        "count |", row
    assert f"seed 0: {methods} of {methods} methods finished" in text
    # an experiment that has not started is said to be so, not under way
    need_data("mnist")
    assert main(["reproduce", "apfl-pd", "--claims", "vehicle-gain", "mnist-gain", "--seeds", "0", "1",
                 "--set", "train.rounds=2", "--out", str(out), "--no-progress", "--status"]) == 0
    text = capsys.readouterr().out
    assert "- `vehicle` (under way: seed 0:" in text and "- `mnist` (not started; " in text
    assert "| vehicle-central:" in text  # a claim of an experiment in the folder is reported, asked for or not
    assert not (out / "mnist").exists()
    assert main(["reproduce", "apfl-pd", "--status", "--out", str(tmp_path / "none")]) != 0
    err = capsys.readouterr().err.strip()
    assert "no reproduction of apfl-pd started there" in err and "\n" not in err
    assert not (tmp_path / "none").exists()


def test_a_started_reproduction_resumes_as_it_started_one_command_at_a_time(tmp_path, capsys):
    """Another --set or --seeds on a started reproduction, a config that no longer matches its saved one, a damaged
    reproduction.yaml, a second command while one runs there, a --set of the seeds, a folder that holds something
    else: each one line, before anything runs or is written. The same command without --set and --seeds resumes
    it (and --status reads it) as it started; a seed lost since is run again."""
    import fcntl
    import os

    need_data("vehicle")
    out = tmp_path / "rep"
    argv = ["reproduce", "apfl-pd", "--claims", "vehicle-gain", "--seeds", "0", "1", "--set", "train.rounds=2",
            "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    capsys.readouterr()
    # the claims of the experiment that ran, asked or not: the same report as after a stop and a resume (below)
    ids = lambda: [c["id"] for c in json.loads((out / "reproduction.json").read_text())["claims"]]  # noqa: E731
    vehicle = [c.id for c in load_paper("apfl-pd").claims if c.experiment == "vehicle"]
    assert ids() == vehicle and len(vehicle) > 1
    state = lambda: {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}  # noqa: E731
    before = state()

    def refused(args, needle):
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and needle in err, err
        assert state() == before

    started = "started with --set train.rounds=2 --seeds 0 1; the same command without --set and --seeds resumes"
    short = ["reproduce", "apfl-pd", "--claims", "vehicle-gain", "--out", str(out), "--no-progress"]
    for status in ([], ["--status"]):
        refused([*argv[:argv.index("1")], *argv[argv.index("1") + 1:], *status], started)  # --seeds 0
        refused([*argv, "--set", "train.rounds=3", *status], started)
    refused([*short, "--set", "seeds=[3]"], "use --seeds")
    assert main([*short, "--status"]) == 0  # the saved --set and --seeds
    assert "(2 seeds)" in next(line for line in capsys.readouterr().out.splitlines() if "| vehicle-gain:" in line)
    saved = (out / "vehicle" / "seeds.yaml").read_text()  # a config that no longer matches (fedmosaic changed)
    (out / "vehicle" / "seeds.yaml").write_text(saved.replace("rounds: 2", "rounds: 5"))
    before = state()
    refused(short, "was started with another config than this fedmosaic builds")
    (out / "vehicle" / "seeds.yaml").write_text(saved)
    request = (out / "reproduction.yaml").read_text()
    for damaged in ("{", "- a\n", ""):
        (out / "reproduction.yaml").write_text(damaged)
        before = state()
        refused(short, "reproduction.yaml is damaged")
    (out / "reproduction.yaml").write_text(request)
    before = state()
    fd = os.open(out, os.O_RDONLY)  # another process holds the folder: what a second command would see
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        refused(short, "is in use by another fedmosaic process")
        assert main([*short, "--status"]) == 0  # reading beside it is fine
    finally:
        os.close(fd)
    capsys.readouterr()
    shutil.rmtree(out / "vehicle" / "seed_1")  # lost: the same command runs it again
    assert main(short) == 0
    assert len(list((out / "vehicle" / "seed_1").glob("*/summary.json"))) == \
        len(list((out / "vehicle" / "seed_0").glob("*/summary.json")))
    assert "vehicle-gain       " in capsys.readouterr().out
    assert ids() == vehicle
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    before = state()
    refused([*argv[:-3], "--out", str(other), "--no-progress"], "holds no reproduction")
    assert (other / "notes.txt").read_text() == "mine"


def test_a_method_that_diverged_in_its_first_round_is_named_and_not_run_again(tmp_path, capsys):
    """At a learning rate of 1e30 APFL-PD (and FedProx) diverge in round 0 on Vehicle, so no run directory of
    theirs is kept; only the seed's table records it. The claims say so, the experiment counts as finished (the same
    command trains nothing again) and `report` names them apart from the variants not run yet."""
    need_data("vehicle")
    out = tmp_path / "rep"
    argv = ["reproduce", "apfl-pd", "--claims", "vehicle-gain", "--seeds", "0", "--set", "train.rounds=2",
            "--set", "train.optimizer.lr=1.0e+30", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    assert not list((out / "vehicle" / "seed_0").glob("apfl_pd*"))
    claims = {c["id"]: c for c in json.loads((out / "reproduction.json").read_text())["claims"]}
    assert claims["vehicle-gain"]["verdict"] == "not run"
    assert claims["vehicle-gain"]["why"].startswith("apfl_pd diverged in its first round in 1 of 1 seeds")
    before = {p: p.stat().st_mtime_ns for p in out.rglob("metrics.jsonl")}
    capsys.readouterr()
    assert main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("metrics.jsonl")} == before
    assert main(["reproduce", "apfl-pd", "--claims", "vehicle-gain", "--out", str(out), "--status"]) == 0
    assert "- `vehicle` (finished before;" in capsys.readouterr().out
    assert main(["report", str(out / "vehicle")]) == 0
    err = capsys.readouterr().err
    assert "diverged in round 0 (no run kept)" in err and "no run yet" not in err


def test_methods_run_one_by_one_then_the_tables_once_all_have_ended(tmp_path, capsys):
    """--methods runs only the methods named (an algorithm's name or a variant's directory name) in every seed and
    leaves the rest as they are, to run later or on another machine with the same folder; a claim is judged once its
    methods have finished; the comparison's tables are written by the command that ends its last method. A name that
    is no method is one line before anything runs."""
    need_data("vehicle")
    out = tmp_path / "rep"
    argv = ["reproduce", "apfl-pd", "--claims", "vehicle-gain", "--seeds", "0", "1", "--set", "train.rounds=2",
            "--out", str(out), "--no-progress"]
    assert main([*argv, "--methods", "fedavg", "fedavgg"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'fedavgg' is no method" in err and "fedprox_mu=1.0" in err and "\n" not in err
    assert not out.exists()
    exp = out / "vehicle"
    ran = lambda s: sorted(p.parent.name for p in (exp / f"seed_{s}").glob("*/config.yaml"))  # noqa: E731
    assert main([*argv, "--methods", "fedavg"]) == 0
    assert ran(0) == ran(1) == ["fedavg"]
    assert all((exp / f"seed_{s}" / "fedavg" / "summary.json").is_file() for s in (0, 1))
    assert not list(exp.rglob("comparison.json"))  # no table of a comparison half run
    claims = {c["id"]: c for c in json.loads((out / "reproduction.json").read_text())["claims"]}
    assert claims["vehicle-gain"]["verdict"] == "not run"
    fedavg = {p: p.stat().st_mtime_ns for p in exp.rglob("fedavg/metrics.jsonl")}
    assert main([*argv[:argv.index("--seeds")], "--out", str(out), "--no-progress", "--methods",
                 "apfl_pd_delta_mu=700.0_delta_sigma=400.0"]) == 0
    assert ran(0) == ran(1) == ["apfl_pd_delta_mu=700.0_delta_sigma=400.0", "fedavg"]
    assert {p: p.stat().st_mtime_ns for p in exp.rglob("fedavg/metrics.jsonl")} == fedavg
    claims = {c["id"]: c for c in json.loads((out / "reproduction.json").read_text())["claims"]}
    assert claims["vehicle-gain"]["seeds"] == 2 and claims["vehicle-gain"]["verdict"] != "not run"
    assert not list(exp.rglob("comparison.json"))
    capsys.readouterr()
    assert main([*argv[:argv.index("--seeds")], "--out", str(out), "--no-progress", "--status"]) == 0
    assert "seed 0: 2 of 6 methods finished; seed 1: 2 of 6 methods finished" in capsys.readouterr().out
    assert main([*argv[:argv.index("--seeds")], "--out", str(out), "--no-progress", "--methods", "fedprox",
                 "fedcurv", "fedmeta", "central"]) == 0  # the last ones: now the tables, over both seeds
    assert {p: p.stat().st_mtime_ns for p in exp.rglob("fedavg/metrics.jsonl")} == fedavg
    table = json.loads((exp / "comparison.json").read_text())
    assert len(table) == 6 and all(r["seeds"] == 2 for r in table)
    assert all((exp / f"seed_{s}" / "comparison.json").is_file() for s in (0, 1))
    capsys.readouterr()
    assert main([*argv[:argv.index("--seeds")], "--out", str(out), "--no-progress", "--status"]) == 0
    assert "- `vehicle` (finished before;" in capsys.readouterr().out
