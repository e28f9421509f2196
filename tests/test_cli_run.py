"""`fedmosaic run`: presets, overrides, config errors as one line, the comparison table and PNG, resume."""

from __future__ import annotations

import json

import pytest
import yaml

from fedmosaic.cli.main import main
from fedmosaic.config import load_config


def test_quickstart_preset_runs_and_writes_table_and_curves(tmp_path, capsys):
    out = tmp_path / "qs"
    assert main(["run", "--no-progress", "--out", str(out), "--set", "train.rounds=3"]) == 0
    text = capsys.readouterr().out
    assert "fedavg" in text and "fedprox(mu=0.1)" in text and "global acc" in text
    assert (out / "learning_curves.png").read_bytes()[:4] == b"\x89PNG"
    for sub in ("fedavg", "fedprox_mu=0.1"):
        lines = (out / sub / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(l)["round"] for l in lines] == [0, 1, 2]
        assert (out / sub / "summary.json").exists() and (out / sub / "meta.json").exists()
    summaries = json.loads((out / "comparison.json").read_text())
    assert {s["algorithm"] for s in summaries} == {"fedavg", "fedprox"}
    # both algorithms saw the same partition
    hashes = {json.loads((out / s / "meta.json").read_text())["data_hash"] for s in ("fedavg", "fedprox_mu=0.1")}
    assert len(hashes) == 1


@pytest.mark.parametrize("override, needle", [
    ("train.rounds=0", "train.rounds: must be greater than or equal to 1 (got 0)"),
    ("train.optimiser.lr=0.1", "train.optimiser: unknown field"),
    ("engine.backend=gpu", "engine.backend: must be 'vectorized' or 'sequential'"),
    ("engine.device=gpu", "engine.device: must be 'auto' or a torch device such as 'cpu' or 'cuda:0' (got 'gpu')"),
    ("algorithm.name=fedsgd", "algorithm.name: unknown 'fedsgd'"),
    ("compare=[{name: fedprox, mu: -1}]", "compare.0.mu: must be greater than or equal to 0"),
    ("data.partition={scheme: dirichlet, alpha: 0}", "partition.alpha"),
    ("data.dataset=nosuch", "data.dataset: unknown dataset 'nosuch'"),
])
def test_config_errors_are_one_line(override, needle, tmp_path, capsys):
    assert main(["run", "--no-progress", "--out", str(tmp_path / "r"), "--set", override]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and err.count("\n") == 0, err


def test_a_device_that_is_not_there_is_a_one_line_error(tmp_path, capsys):
    import torch

    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU (cuda:0 on a CPU-only machine)
    assert main(["run", "--no-progress", "--out", str(tmp_path / "r"), "--set", f"engine.device={missing}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"engine.device: '{missing}' is not available" in err and "\n" not in err
    assert not (tmp_path / "r").exists()


def test_yaml_file_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    assert main(["run", str(bad)]) == 2
    assert "invalid YAML" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.yaml")]) == 2
    assert "neither a file nor a preset" in capsys.readouterr().err


def test_resume_a_finished_and_an_interrupted_run(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"name": "one", "data": {"clients": 6}, "train": {"rounds": 2},
                                   "algorithm": {"name": "fedavg"}}))
    out = tmp_path / "r"
    assert main(["run", str(cfg), "--no-progress", "--out", str(out)]) == 0
    assert main(["run", str(cfg), "--no-progress", "--out", str(out)]) == 2  # never overwritten
    assert "already exists" in capsys.readouterr().err
    assert main(["run", "--no-progress", "--resume", str(out)]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_report_compares_existing_runs_at_a_common_round(tmp_path, capsys):
    runs = []
    for algo, rounds in (("fedavg", 3), ("fedprox", 2)):
        out = tmp_path / algo
        assert main(["run", "--no-progress", "--out", str(out), "--set", f"name={algo}", "--set", "data.clients=6",
                     "--set", f"train.rounds={rounds}", "--set", f"algorithm={{name: {algo}}}",
                     "--set", "compare=null"]) == 0
        runs.append(str(out))
    capsys.readouterr()
    plot = tmp_path / "cmp.png"
    assert main(["report", *runs, "--rounds", "2", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("fedavg", "fedprox"))}
    assert rows["fedavg"][1] == rows["fedprox"][1] == "2"
    fedavg_round2 = json.loads((tmp_path / "fedavg" / "metrics.jsonl").read_text().splitlines()[1])["global"]["acc"]
    assert rows["fedavg"][2] == f"{fedavg_round2:.2%}"
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert main(["report", *runs, "--rounds", "3", "--plot", str(plot)]) == 2  # never overwrites a plot
    assert "already exists" in capsys.readouterr().err
    assert main(["report", *runs, "--rounds", "3"]) == 0
    assert "has only 2 rounds" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_preset_file_is_valid():
    from fedmosaic.presets import preset_names, preset_path

    for name in preset_names():
        load_config(preset_path(name))
