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
    assert "fedavg" in text and "local" in text and "ditto" in text and "global acc" in text
    assert (out / "learning_curves.png").read_bytes()[:4] == b"\x89PNG"
    for sub in ("fedavg", "local", "ditto"):
        lines = (out / sub / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(l)["round"] for l in lines] == [0, 1, 2]
        assert (out / sub / "summary.json").exists() and (out / sub / "meta.json").exists()
    summaries = json.loads((out / "comparison.json").read_text())
    assert {s["algorithm"] for s in summaries} == {"fedavg", "local", "ditto"}
    # both algorithms saw the same partition
    hashes = {json.loads((out / s / "meta.json").read_text())["data_hash"] for s in ("fedavg", "local", "ditto")}
    assert len(hashes) == 1


@pytest.mark.parametrize("override, needle", [
    ("train.rounds=0", "train.rounds: must be greater than or equal to 1 (got 0)"),
    ("train.optimiser.lr=0.1", "train.optimiser: unknown field"),
    ("engine.backend=gpu", "engine.backend: must be 'vectorized' or 'sequential'"),
    ("engine.device=gpu", "engine.device: must be 'auto', 'cpu', 'mps' or a CUDA device such as 'cuda:0' (got 'gpu')"),
    ("engine.device=meta", "engine.device: must be 'auto', 'cpu', 'mps' or a CUDA device such as 'cuda:0' (got 'meta')"),
    ("train.optimiser.lr=0.1", "train.optimiser: unknown field; did you mean 'optimizer'?"),
    ("algorithm.name=fedsgd", "algorithm.name: unknown 'fedsgd'"),
    ("compare=[{name: fedprox, mu: -1}]", "compare.0.mu: must be greater than or equal to 0"),
    ("data.partition={scheme: dirichlet, alpha: 0}", "partition.alpha"),
    ("data.dataset=nosuch", "data.dataset: unknown dataset 'nosuch'"),
    # strict types, ranges (nested too), empty lists, typos, devices, models vs inputs, memory
    ("train.rounds=true", "train.rounds: must be a valid integer (got True)"),
    ("train.rounds=2.0", "train.rounds: must be a valid integer (got 2.0)"),
    ("seed=-1", "seed: must be greater than or equal to 0 (got -1)"),
    ("data.partition.alpha=.inf", "data.partition.alpha: must be a finite number (got inf)"),
    ("train.optimizer.betas=[0.9, 1.0]", "train.optimizer.betas: each must be in [0, 1) (got [0.9, 1.0])"),
    ("train.optimizer.lr=.nan", "train.optimizer.lr: must be a finite number"),
    ("train.optimizer.lr=1e-3", "YAML reads 1e-3 as text, write 1.0e-3"),
    ("data.classes=[]", "data.classes: must not be empty"),
    ("model.heterogeneous=[]", "model.heterogeneous: must not be empty"),
    ("compare=[]", "compare: must not be empty"),
    ("train.clients_per_round=21", "train.clients_per_round: must be <= data.clients = 20 (got 21)"),
    ("trian.rounds=3", "trian: unknown field; did you mean 'train'?"),
    ("algorithm={name: fedprox, muu: 1}", "algorithm.muu: unknown field; did you mean 'mu'?"),
    ("data.partition.aplha=0.1", "data.partition.aplha: unknown parameter; did you mean 'alpha'?"),
    ("algorithm.name=fedavgg", "algorithm.name: unknown 'fedavgg'; did you mean 'fedavg'?"),
    ("=5", "--set '=5': empty key"),
    ("train..rounds=1", "--set 'train..rounds=1': empty part in the key"),
    ("model.name=cnn4", "model 'cnn4': input (1, 8, 8) is too small for this CNN"),
    ("model.options={hidden: 0}", "hidden: must be a width >= 1"),
    ("model.options={hidden: 1000000000}", "parameters; model.options) needs about 279.4 GiB, more than the"),
    ("train.local_epochs=1000000000", "the local batch plan"),
    ("data.augment.cutout=100", "data.augment.cutout: must be <= the image side 8 (got 100)"),
    ("model.heterogeneous=[{name: mlp}, {name: logreg}]", "model.heterogeneous: algorithm 'fedavg' averages one"),
])
def test_config_errors_are_one_line(override, needle, tmp_path, capsys):
    assert main(["run", "--no-progress", "--out", str(tmp_path / "r"), "--set", override]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and err.count("\n") == 0, err


@pytest.mark.parametrize("which", ["cuda", "mps"])
def test_a_device_that_is_not_there_is_a_one_line_error(which, tmp_path, capsys):
    import torch

    if which == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    missing = f"cuda:{torch.cuda.device_count()}" if which == "cuda" else "mps"  # one past the last GPU
    assert main(["run", "--no-progress", "--out", str(tmp_path / "r"), "--set", f"engine.device={missing}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"engine.device: '{missing}' is not available" in err and "\n" not in err
    assert not (tmp_path / "r").exists()


def test_clients_per_round_larger_than_a_scheme_fixed_federation(tmp_path, capsys):
    # apfl_mnist fixes the client count (partition.users), so this is only known once the partition is
    argv = ["run", "--no-progress", "--out", str(tmp_path / "r"), "--set", "compare=null", "--set", "data.clients=null",
            "--set", "data.partition={scheme: apfl_mnist, users: 5, first: 2}", "--set", "train.clients_per_round=6"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == "fedmosaic: error: train.clients_per_round: must be <= the 5 clients of this partition (got 6)"
    assert not (tmp_path / "r").exists()


def test_batch_larger_than_every_client_is_the_full_batch(tmp_path):
    """A batch of 10^9 is capped at the largest client (same results as a batch of exactly that size)."""
    out = {}
    for b in (1_000_000_000, 1000):
        out[b] = tmp_path / str(b)
        assert main(["run", "--no-progress", "--out", str(out[b]), "--set", "compare=null", "--set",
                     "train.rounds=2", "--set", f"train.batch_size={b}"]) == 0
    curves = [[json.loads(ln)["train_loss"] for ln in (o / "metrics.jsonl").read_text().splitlines()]
              for o in out.values()]
    assert curves[0] == curves[1]


@pytest.mark.parametrize("content, needle", [
    (b"", "the file is empty (or only comments)"),
    (b"# nothing but a comment\n\n", "the file is empty (or only comments)"),
    (b"train:\n  rounds: \xff\xfe\n", "not UTF-8 text (byte 0xff at offset 17)"),
    (b"[" * 20000, "nested too deeply"),
    (b"a: &a [1,1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
     b"d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\n", "more than 100,000 values"),
    (b"- a list\n", "the top level must be a mapping"),
    (b"!!python/object/apply:os.system [echo hi]\n", "invalid YAML"),
    (b"train: {rounds: 2, batch_size: 8}\nmodel: {name: mlp}\ntrain:\n  rounds: 5\n",
     "bad.yaml: 'train' is given twice (lines 1 and 3); keep one"),
    (b"train:\n  rounds: 2\n  rounds: 5\n", "'rounds' is given twice (lines 2 and 3)"),
    # YAML 1.1 numbers that read as other than they look: seed 8, 60 rounds, 3 rounds, lr 90.0
    (b"seed: 010\n", "'010' (line 1) is an octal number in YAML 1.1 (8)"),
    (b"train:\n  rounds: 1:00\n", "'1:00' (line 2) is a base-60 number in YAML 1.1 (60)"),
    (b"train: {rounds: 0b11}\n", "'0b11' (line 1) is a binary number in YAML 1.1 (3)"),
    (b"train: {optimizer: {lr: 1:30.0}}\n", "'1:30.0' (line 1) is a base-60 number"),
])
def test_unreadable_config_files(content, needle, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and err.count("\n") == 0, err


def test_a_key_that_overrides_a_merged_one_is_no_repeat(tmp_path, capsys):
    """``<<: *base`` then the key again is YAML's way to override; a ``--set`` value's own repeat is
    refused."""
    from fedmosaic.config import read_yaml

    merged = tmp_path / "merged.yaml"
    merged.write_text("base: &base {rounds: 2, batch_size: 8}\ntrain:\n  <<: *base\n  rounds: 5\n")
    assert read_yaml(merged)["train"] == {"rounds": 5, "batch_size": 8}
    assert main(["run", "--check", "--set", "train={rounds: 1, rounds: 2}"]) == 2
    assert "--set value '{rounds: 1, rounds: 2}': 'rounds' is given twice (line 1)" in capsys.readouterr().err
    assert main(["run", "--check", "--set", "seed=010"]) == 2
    assert "--set value '010': '010' (line 1) is an octal number" in capsys.readouterr().err
    for plain in ("seed=10", "seed=0", "train.rounds=0x3", "train.rounds=1_0", "name=010x"):  # read as they look
        assert main(["run", "--check", "--set", plain]) == 0, plain


def test_yaml_file_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    assert main(["run", str(bad)]) == 2
    assert "invalid YAML" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.yaml")]) == 2
    assert "neither a file nor a preset" in capsys.readouterr().err


def test_resume_a_finished_and_an_interrupted_run(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"name": "one", "data": {"clients": 6}, "train": {"rounds": 2, "clients_per_round": 3},
                                   "algorithm": {"name": "fedavg"}}))
    out = tmp_path / "r"
    assert main(["run", str(cfg), "--no-progress", "--out", str(out)]) == 0
    assert main(["run", str(cfg), "--no-progress", "--out", str(out)]) == 2  # never overwritten
    assert "already exists" in capsys.readouterr().err
    assert main(["run", "--no-progress", "--resume", str(out)]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_resume_of_a_folder_a_user_made_around_a_config_changes_nothing(tmp_path, capsys):
    """A folder holding a hand-written config.yaml beside the user's own files is no run: a resume replaced their
    metrics.jsonl, table.md and summary.json without a word (it took the missing meta.json for a run stopped while
    starting, which holds nothing but its config)."""
    out = tmp_path / "exp"
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump({"name": "mine", "data": {"clients": 6}, "train": {
        "rounds": 1, "clients_per_round": 3}, "algorithm": {"name": "fedavg"}}))
    mine = {"metrics.jsonl": '{"round": 0, "mine": 1}\n', "table.md": "| mine |\n", "summary.json": "{}"}
    for name, text in mine.items():
        (out / name).write_text(text)
    assert main(["run", "--no-progress", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds a config.yaml but no meta.json, beside metrics.jsonl, summary.json, table.md" in err, err
    assert {p.name: p.read_text() for p in out.iterdir() if p.name != "config.yaml"} == mine
    (out / "config.yaml").rename(tmp_path / "c.yaml")  # a run stopped while starting holds its config alone
    for p in out.iterdir():
        p.unlink()
    (tmp_path / "c.yaml").rename(out / "config.yaml")
    assert main(["run", "--no-progress", "--resume", str(out)]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1 and (out / "meta.json").exists()


def test_report_compares_existing_runs_at_a_common_round(tmp_path, capsys):
    runs = []
    for algo, rounds in (("fedavg", 3), ("fedprox", 2)):
        out = tmp_path / algo
        assert main(["run", "--no-progress", "--out", str(out), "--set", f"name={algo}", "--set", "data.clients=6", "--set", "train.clients_per_round=3",
                     "--set", f"train.rounds={rounds}", "--set", f"algorithm={{name: {algo}}}",
                     "--set", "compare=null"]) == 0
        runs.append(str(out))
    capsys.readouterr()
    plot = tmp_path / "cmp.png"
    assert main(["report", *runs, "--rounds", "2", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out.split("\n\n")[0]  # the summary table (the loss terms' table follows)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("fedavg", "fedprox"))}
    assert rows["fedavg"][1] == rows["fedprox"][1] == "2"
    fedavg_round2 = json.loads((tmp_path / "fedavg" / "metrics.jsonl").read_text().splitlines()[1])["global"]["acc"]
    assert rows["fedavg"][2] == f"{fedavg_round2:.2%}"
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "cmp-diagnostics.png").read_bytes()[:4] == b"\x89PNG"  # fedprox's proximal term per round
    assert main(["report", *runs, "--rounds", "3", "--plot", str(plot)]) == 2  # never overwrites a plot
    assert "already exists" in capsys.readouterr().err
    (tmp_path / "new-tasks.png").write_text("mine")  # nor the per-task plot named after it
    assert main(["report", *runs, "--plot", str(tmp_path / "new.png")]) == 2
    assert "new-tasks.png already exists" in capsys.readouterr().err and not (tmp_path / "new.png").exists()
    (tmp_path / "new-tasks.png").unlink()
    (tmp_path / "new-diagnostics.png").write_text("mine")  # nor the diagnostics plot
    assert main(["report", *runs, "--plot", str(tmp_path / "new.png")]) == 2
    assert "new-diagnostics.png already exists" in capsys.readouterr().err and not (tmp_path / "new.png").exists()
    assert (tmp_path / "new-diagnostics.png").read_text() == "mine"
    assert main(["report", *runs, "--plot", str(tmp_path / "c.jpg")]) == 2  # a format it does not write: no
    assert "ending in .png, .pdf, .svg" in capsys.readouterr().err and not (tmp_path / "c.jpg").exists()
    assert main(["report", *runs, "--plot", str(tmp_path / "c.pdf")]) == 0  # for a paper: vector, as named
    assert (tmp_path / "c.pdf").read_bytes()[:5] == b"%PDF-"
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "gone").symlink_to(tmp_path / "nothing")
    capsys.readouterr()
    for above in ("afile", "gone"):  # a file or a link to nothing where the plot's folder must be: said first
        assert main(["report", *runs, "--plot", str(tmp_path / above / "p.png")]) == 2
        out, err = capsys.readouterr()
        assert f"{above} is not a folder" in err and err.count("\n") == 1 and out == "", err
    from fedmosaic.reports import compare
    from_runs = compare.from_runs

    def someone_writes_the_plot_meanwhile(*args):
        (tmp_path / "late.png").write_text("theirs")  # after the up-front check, before the plot is written
        return from_runs(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compare, "from_runs", someone_writes_the_plot_meanwhile)
        assert main(["report", *runs, "--plot", str(tmp_path / "late.png")]) == 2
    assert "late.png appeared while the report ran" in capsys.readouterr().err
    assert (tmp_path / "late.png").read_text() == "theirs"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".late.png")]  # no temporary file left
    assert main(["report", *runs, "--rounds", "3"]) == 0
    assert "has only 2 rounds" in capsys.readouterr().err
    assert main(["report", *runs]) == 0  # without --rounds: at the last round both reached, said so
    out, err = capsys.readouterr()
    rows = {line.split()[0]: line.split() for line in out.split("\n\n")[0].splitlines()
            if line.startswith(("fedavg", "fedprox"))}
    assert rows["fedavg"][1] == rows["fedprox"][1] == "2" and rows["fedavg"][2] == f"{fedavg_round2:.2%}"
    assert "stopped at different rounds (2, 3): compared at round 2" in err
    assert main(["report", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_preset_file_is_valid():
    from fedmosaic.presets import preset_names, preset_path

    for name in preset_names():
        load_config(preset_path(name))


def test_list_shows_every_algorithm_with_its_hyper_parameters(capsys):
    from fedmosaic.algorithms import ALGORITHMS
    from fedmosaic.models import MODELS
    from fedmosaic.presets import preset_names

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name, algo in ALGORITHMS.items():
        at = next(i for i, line in enumerate(lines) if line.startswith(f"  {name} "))
        block = []
        for line in lines[at + 1:]:  # the indented lines under the algorithm's name
            if not line.startswith("    "):
                break
            block.append(line.strip())
        listed = [b.split(":")[0] for b in block if b != "(no hyper-parameters)"]
        assert listed == list(algo.Config.model_fields), name
    assert "mu: float = 0.1  (>= 0)" in out and "tau: float = 1.0  (> 0)" in out
    assert all(f"\n  {m} " in out for m in MODELS) and "options: hidden=100" in out
    assert all(f"\n  {p} " in out for p in preset_names())
    assert "digits" in out and "built-in" in out
    assert main(["list", "algorithm"]) == 2
    assert capsys.readouterr().err.strip() == ("fedmosaic: error: list: unknown section 'algorithm'; allowed: "
                                               "algorithms, models, presets, datasets")


def test_compare_takes_the_configs_own_list_and_refuses_a_config_without_one(tmp_path, capsys):
    """README: `fedmosaic compare quickstart --seeds 0 1 2` — the preset's compare: list, every seed."""
    out = tmp_path / "cmp"
    assert main(["compare", "quickstart", "--seeds", "0", "1", "--set", "train.rounds=1", "--no-progress",
                 "--out", str(out)]) == 0
    names = {s["name"] for s in json.loads((out / "comparison.json").read_text())}
    assert names == {"fedavg", "local", "ditto"}
    assert (out / "seed_0").is_dir() and (out / "seed_1").is_dir()
    capsys.readouterr()
    assert main(["compare", "quickstart", "--set", "compare=null", "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "compare: name the algorithms (--algorithms" in err and err.count("\n") == 1
    assert not (tmp_path / "none").exists()


def test_a_plugin_that_exits_while_imported_is_an_error_not_a_silent_success(tmp_path, monkeypatch, capsys):
    (tmp_path / "exiting_plugin.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["--plugin", "exiting_plugin", "run", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "plugin 'exiting_plugin': it called sys.exit(0) while being imported" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
