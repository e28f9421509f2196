"""What a new user meets first: `fedmosaic list` (each preset's runtime, no internal references), a mistyped
name answered with the nearest valid one, and `fedmosaic list | head` ending without a "Broken pipe" error."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import yaml
from fedtest import HANG_S

from fedmosaic.cli.main import main
from fedmosaic.presets import preset_choices, preset_names, preset_path

LIST = [sys.executable, "-m", "fedmosaic.cli.main", "list"]


@pytest.mark.slow
def test_list_into_a_reader_that_went_away_ends_quietly():
    # the reader is gone before the first write (the read end of the pipe is closed): always a broken pipe
    read, write = os.pipe()
    os.close(read)
    try:
        gone = subprocess.run(LIST, stdout=write, stderr=subprocess.PIPE, text=True, timeout=HANG_S)
    finally:
        os.close(write)
    assert (gone.returncode, gone.stderr) == (128 + signal.SIGPIPE, "")
    # `fedmosaic list | head -1`: the first line, then a quiet end
    pipe = 'set -o pipefail; "$@" | head -1'
    head = subprocess.run(["bash", "-c", pipe, "bash", *LIST], capture_output=True, text=True, timeout=HANG_S)
    assert head.stdout == "algorithms:\n" and head.stderr == ""
    assert head.returncode in (0, 128 + signal.SIGPIPE)  # 0 if every line fitted in the pipe before head left


@pytest.mark.parametrize("value", ["100000", "abc"])
def test_an_omp_thread_count_that_is_none_is_one_line_before_openmp_reads_it(value, tmp_path):
    """OMP_NUM_THREADS=100000 crashed the run (SIGSEGV, no word); =abc printed OpenMP's own line and was ignored.
    The CLI now refuses it in one line (exit 2) before torch is imported, nothing written."""
    run = [sys.executable, "-m", "fedmosaic.cli.main", "run", "--set", "train.rounds=1", "--out", str(tmp_path / "r")]
    got = subprocess.run(run, capture_output=True, text=True, timeout=HANG_S,
                         env={**os.environ, "OMP_NUM_THREADS": value})
    assert got.returncode == 2 and got.stderr == (f"fedmosaic: error: OMP_NUM_THREADS: a thread count in [1, 1024] "
                                                  f"(got '{value}'); unset it to let fedmosaic choose\n"), got.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv, typo, near", [
    (["run", "--set", "data.partition.scheme={}"], "dirichlt", "dirichlet"),
    (["partition", "--dataset", "digits", "--clients", "5", "--scheme", "{}"], "Shards", "shards"),
    (["run", "--set", "model.name={}"], "mpl", "mlp"),
])
def test_a_mistyped_name_is_answered_with_the_nearest_valid_one(argv, typo, near, tmp_path, capsys):
    for name, hint in ((typo, f"did you mean {near!r}? "), ("voronoi", "")):  # nothing near 'voronoi'
        assert main([*(a.format(name) for a in argv), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fedmosaic: error: ") and err.count("\n") == 1
        assert re.search(rf"unknown '{name}'( \(.*\))?; {re.escape(hint)}allowed: ", err), err
    assert not (tmp_path / "out").exists()


def test_a_mistyped_preset_name_is_answered_with_the_nearest_preset(tmp_path, capsys):
    assert main(["run", "quikstart", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("fedmosaic: error: config 'quikstart' is neither a file nor a preset; "
                                              "did you mean 'quickstart'? presets: ")
    assert preset_choices("quikstart").startswith("did you mean 'quickstart'? presets: ahf-digits, ")
    assert preset_choices("apfl-cifar").startswith("did you mean 'apfl-cifar10'? presets: ")
    assert preset_choices("my-own.yaml") == f"presets: {', '.join(preset_names())}"


def test_list_presets_shows_each_presets_runtime(capsys):
    assert main(["list", "presets"]) == 0
    out = capsys.readouterr().out
    for name in preset_names():
        # a whole run on a 2-core CPU, "~" when extrapolated from timed rounds
        line = re.search(rf"^  {re.escape(name)} +(~?[\d.]+ (s|min|h|days))( x (\d+))?  \S", out, re.MULTILINE)
        assert line, f"no runtime for {name} in:\n{out}"
        methods = len(yaml.safe_load(preset_path(name).read_text()).get("compare") or [])  # one method's time, x N
        assert int(line[4] or 1) == max(methods, 1), (name, line[0])
        comment = [ln for ln in preset_path(name).read_text().splitlines() if ln.startswith("# runtime: ")]
        assert len(comment) == 1, name  # and it says how the time was found
        assert ("(estimated: " if line[1].startswith("~") else "(measured: ") in comment[0], name


def test_what_users_read_has_no_internal_references(capsys):
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    for argv in ([], ["run"], ["compare"], ["report"], ["list"], ["partition"], ["data"], ["data", "list"]):
        assert main([*argv, "--help"]) == 0
        text += capsys.readouterr().out
    assert len(text) > 10_000
    assert not re.search(r"METHODS\.md|§|paper 0\d\d|\(00\d|issue \d|our copy", text), \
        re.search(r".{0,60}(METHODS\.md|§|paper 0\d\d|\(00\d|issue \d|our copy).{0,60}", text)[0]


def test_global_options_after_the_subcommand_a_folder_that_is_not_there_and_a_near_dataset_name(tmp_path, capsys):
    """What the messages suggest works where users type it: --data-dir / --plugin after the subcommand; a data
    folder that does not exist is named as such; a misspelt dataset gets a "did you mean"."""
    from fedmosaic.cli.main import main

    missing = tmp_path / "no-such-data"
    assert main(["run", "--data-dir", str(missing), "--set", "data.dataset=mnist", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"{missing} [no such folder]" in err and err.count("\n") == 1
    assert main(["run", "--set", "data.dataset=cifr10", "--out", str(tmp_path / "r")]) == 2
    assert "did you mean 'cifar10'?" in capsys.readouterr().err
    (tmp_path / "quiet_plugin.py").write_text("REGISTERED = True\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert main(["list", "presets", "--plugin", "quiet_plugin"]) == 0
        assert sys.modules["quiet_plugin"].REGISTERED
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("quiet_plugin", None)
    assert not (tmp_path / "r").exists()


def test_list_presets_never_cuts_a_description_mid_sentence(capsys):
    """Each preset's description is its opening comment (up to its runtime line) whole, or that comment's first
    sentence, or marked as cut (…) — never a line that stops mid-sentence (deploy-quickstart's did)."""
    from fedmosaic.cli.main import main
    from fedmosaic.presets import preset_path

    assert main(["list", "presets"]) == 0
    for row in capsys.readouterr().out.splitlines()[2:]:
        name, about = row.split()[0], row.split("  ")[-1].strip()
        block = []
        for line in preset_path(name).read_text().splitlines():
            if not line.startswith("#") or line.startswith("# runtime:"):
                break
            block.append(line.lstrip("# ").strip())
        whole = " ".join(block)
        assert about == whole or (whole.startswith(about[:-1]) and about.endswith((".", "…"))), (about, whole)


@pytest.mark.parametrize("argv, needle", [
    (["run", "--out", "x", "--runs-dir", "y"], "--runs-dir: where a new run directory goes when no --out names it"),
    (["run", "--out", ""], "argument --out: an empty path"),
    (["run", "--resume", " "], "argument --resume: an empty path"),
    (["report", "somewhere", "--title", "T"], "--title: the title of the plot; give --plot FILE too"),
    (["reproduce", "apfl-pd", "--list", "--claims", "nonsense"], "it takes --scale alone (got --claims)"),
    (["reproduce", "apfl-pd", "--list", "--out", "x", "--status"], "(got --out, --status)"),
])
def test_an_option_the_command_would_ignore_is_refused_in_one_line(argv, needle, tmp_path, monkeypatch, capsys):
    """A review found each accepted and silently ignored (an empty --out fell back to runs/<name>-<time>)."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
    assert not any(tmp_path.iterdir())  # nothing written


def test_errors_name_what_the_user_gave(tmp_path, capsys):
    """A review found messages naming the wrong thing: deploy's existing --out offered a --resume deploy has not;
    a damaged config.yaml among report's runs was not named."""
    (tmp_path / "dep").mkdir()
    (tmp_path / "dep" / "mine.txt").write_text("mine")
    assert main(["deploy", "deploy-quickstart", "--out", str(tmp_path / "dep")]) == 2
    err = capsys.readouterr().err
    assert "deployment directory" in err and "already exists; choose another --out" in err and "--resume" not in err
    run = tmp_path / "r"
    assert main(["run", "--set", "compare=null", "--set", "train.rounds=1", "--out", str(run), "--no-progress"]) == 0
    with open(run / "config.yaml", "a") as f:
        f.write("nonsense: 3\n")
    capsys.readouterr()
    assert main(["report", str(run)]) == 2
    assert capsys.readouterr().err.startswith(f"fedmosaic: error: {run / 'config.yaml'}: nonsense: unknown field")


def test_check_refuses_an_out_or_runs_dir_below_a_file_as_the_run_would(tmp_path, capsys):
    """--check said ok for --out afile/x (the run then failed: Not a directory) and never looked at --runs-dir."""
    (tmp_path / "afile").write_text("mine")
    for argv, needle in ((["--out", str(tmp_path / "afile" / "x")], "is a file, not a folder; choose another --out"),
                         (["--runs-dir", str(tmp_path / "afile")],
                          "is a file, not a folder; choose another --runs-dir")):
        for check in (["--check"], ["--set", "train.rounds=1", "--no-progress"]):
            assert main(["run", *argv, *check]) == 2
            err = capsys.readouterr().err
            assert needle in err and err.count("\n") == 1, err
    assert (tmp_path / "afile").read_text() == "mine"
