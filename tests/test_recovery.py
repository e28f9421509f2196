"""Run names, output locations, damaged run directories, divergence and signals: every failure is one line, and a
run directory that holds finished rounds can always be resumed to the metrics of an uninterrupted run."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fedmosaic.cli.main import main
from fedmosaic.errors import FedMosaicError
from fedmosaic.runs.checkpoints import latest_checkpoint
from fedmosaic.runs.records import TIMING_KEYS, read_metrics

SMALL = {
    "name": "small", "seed": 1,
    "data": {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"}, "client_test": 0.25},
    "model": {"name": "mlp", "options": {"hidden": 8}},
    "train": {"rounds": 4, "clients_per_round": 2, "batch_size": 32, "optimizer": {"lr": 0.05}},
    "checkpoint_every": 1,
}


def write_cfg(tmp_path, **changes) -> Path:
    cfg = json.loads(json.dumps(SMALL))
    for key, value in changes.items():
        node = cfg
        *path, last = key.split("__")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def cli(*argv) -> tuple[int, str]:
    """Exit status and stderr of an in-process CLI call (stderr via a file: capsys is per test)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main([*argv])
    return rc, err.getvalue()


def error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines()
             if ln.strip() and not ln.startswith(("fedmosaic: warning:", "fedmosaic: note:"))]
    assert len(lines) == 1 and lines[0].startswith("fedmosaic: error: ") and "Traceback" not in stderr, stderr
    return lines[0]


def metrics(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(out)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every recovery must reproduce."""
    tmp = tmp_path_factory.mktemp("ref")
    out = tmp / "full"
    assert cli("run", str(write_cfg(tmp)), "--no-progress", "--out", str(out))[0] == 0
    return metrics(out)


# ---- 2. run names are names ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name, needle", [
    ("../../x", "must be a plain name"), ("<absolute>", "must be a plain name"), ("a/b", "must be a plain name"),
    ("", "must not be empty"),
    ("nul\x00byte", "must be a plain name"), ("x" * 300, "must be at most 100 bytes"), ("..", "must not be '.', '..'"),
])
def test_run_names_cannot_escape_the_runs_directory(name, needle, tmp_path, monkeypatch):
    work = tmp_path / "a" / "b" / "work"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    if name == "<absolute>":
        name = str(tmp_path / "elsewhere" / "x")
    cfg = write_cfg(work, name=name)
    rc, err = cli("run", str(cfg), "--no-progress", "--runs-dir", "runs")
    assert rc == 2 and f"fedmosaic: error: name: {needle}" in error_line(err)
    # refused before anything was created, anywhere
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b", "cfg.yaml", "work"]


def test_a_plain_name_makes_a_run_directory_inside_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli("run", str(write_cfg(tmp_path, name="my run (v2)", train__rounds=1)), "--no-progress")[0] == 0
    [made] = (tmp_path / "runs").iterdir()
    assert made.name.startswith("my run (v2)-") and (made / "summary.json").exists()


# ---- 3. output locations ------------------------------------------------------------------------------------
def test_out_that_is_an_existing_file(tmp_path):
    target = tmp_path / "taken"
    target.write_text("user data")
    rc, err = cli("run", str(write_cfg(tmp_path)), "--no-progress", "--out", str(target))
    assert rc == 2 and "exists and is not a directory" in error_line(err)
    assert target.read_text() == "user data"


def test_out_through_a_dangling_symlink_is_refused_at_once(tmp_path, monkeypatch):
    """A link whose target is gone: one line naming it, before the data are read; nothing made at its
    target."""
    import fedmosaic.runs.runner as runner

    monkeypatch.setattr(runner, "build_federation", lambda *a, **k: pytest.fail("got as far as building it"))
    link, gone = tmp_path / "link", tmp_path / "gone" / "x"
    link.symlink_to(gone)
    cfg = str(write_cfg(tmp_path))
    for argv in (["--out", str(link)], ["--out", str(link / "r")], ["--check", "--out", str(link)],
                 ["--out", str(link), "--seeds", "1", "2"], ["--runs-dir", str(link)]):
        rc, err = cli("run", cfg, "--no-progress", *argv)
        line = error_line(err)
        assert rc == 2 and f"{link} is a symbolic link to {gone}, which does not exist" in line, line
        assert ("--runs-dir" if "--runs-dir" in argv else "--out") in line
    assert not (tmp_path / "gone").exists()


def _read_only_dir(path: Path):
    """A directory nobody may write to: a read-only tmpfs for root (who ignores permissions), else chmod."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(stat.S_IRUSR | stat.S_IXUSR)
        return lambda: path.chmod(stat.S_IRWXU)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                      capture_output=True).returncode:
        pytest.skip("running as root without permission to mount a read-only tmpfs")
    return lambda: subprocess.run(["umount", "-l", str(path)])


def test_read_only_runs_directory(tmp_path):
    ro = tmp_path / "ro"
    undo = _read_only_dir(ro)
    try:
        rc, err = cli("run", str(write_cfg(tmp_path)), "--no-progress", "--runs-dir", str(ro))
        line = error_line(err)
        assert rc == 2 and "cannot create a run directory in" in line and ("Read-only" in line or "Permission" in line)
        # an explicit --out there too
        rc, err = cli("run", str(write_cfg(tmp_path)), "--no-progress", "--out", str(ro / "r"))
        line = error_line(err)
        assert rc == 2 and "cannot write the run directory" in line and ("Read-only" in line or "Permission" in line)
    finally:
        undo()


def _fail_checkpoint_at(monkeypatch, round_idx: int):
    real = torch.save

    def save(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("round") == round_idx:
            f.write(b"partial")  # some bytes reach the disk before it fills up
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)


def test_full_disk_is_one_line_and_the_run_resumes(tmp_path, monkeypatch, reference):
    out = tmp_path / "my runs" / "r"  # the printed command must survive a space
    _fail_checkpoint_at(monkeypatch, 2)
    rc, err = cli("run", str(write_cfg(tmp_path)), "--no-progress", "--out", str(out))
    line = error_line(err)
    assert rc == 2 and "No space left on device" in line and f"fedmosaic run --resume '{out}'" in line
    assert not list(out.rglob("*.tmp"))  # the partial checkpoint did not stay
    monkeypatch.undo()  # space freed
    assert cli("run", "--no-progress", "--resume", str(out))[0] == 0
    assert metrics(out) == reference


def test_a_really_full_disk(tmp_path):
    """The same on a real filesystem that runs out of space: a 200 KiB tmpfs, enlarged before resuming."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(disk)],
                                           capture_output=True).returncode:
        pytest.skip("needs root and permission to mount a tmpfs")
    cfg = write_cfg(tmp_path, model__options={"hidden": 256})  # checkpoints of ~80 KB: the third does not fit
    try:
        out = disk / "r"
        rc, err = cli("run", str(cfg), "--no-progress", "--out", str(out))
        line = error_line(err)
        assert rc == 2 and "No space left on device" in line, line
        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        assert cli("run", "--no-progress", "--resume", str(out))[0] == 0
        assert cli("run", str(cfg), "--no-progress", "--out", str(tmp_path / "full"))[0] == 0
        assert metrics(out) == metrics(tmp_path / "full")
    finally:
        subprocess.run(["umount", "-l", str(disk)])  # lazy: never leave a mount behind, even after a failure


# ---- 4. resume survives damage ------------------------------------------------------------------------------
def _cut(tmp_path, after: int) -> Path:
    """A run "killed" once round ``after`` is done (checkpoints every round)."""
    from fedmosaic.config import load_config
    from fedmosaic.runs.runner import run

    out = tmp_path / "cut"
    run(load_config(write_cfg(tmp_path)), out, progress=False, stop_after=after)
    return out


def test_meta_names_the_hardware_of_the_start_and_of_each_resume(tmp_path, reference, monkeypatch):
    """Runs that span machines (a session's background job resumed on the next one) name each machine."""
    from fedmosaic.runs import dirs

    out = _cut(tmp_path, 2)
    first = json.loads((out / "meta.json").read_text())["hardware"]
    assert first["cpu"] == dirs.cpu_name() and first["cpu"] and first["cores"] == os.cpu_count() and first["gpu"] is None
    monkeypatch.setattr(dirs, "cpu_name", lambda: "Another CPU")
    assert cli("run", "--no-progress", "--resume", str(out))[0] == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["hardware"] == first  # (where it started)
    [resumed] = meta["resumed"]
    assert resumed["from_round"] == 3 and resumed["hardware"]["cpu"] == "Another CPU"
    assert metrics(out) == reference


def test_truncated_last_metrics_line_is_recomputed(tmp_path, reference):
    out = _cut(tmp_path, 2)
    text = (out / "metrics.jsonl").read_text()
    (out / "metrics.jsonl").write_text(text[: len(text) - 40])  # the last line lost its end
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0 and "line 3 is damaged" in err and "fedmosaic: warning:" in err
    assert metrics(out) == reference


def test_metrics_lines_lost_behind_a_checkpoint_are_recomputed(tmp_path, reference):
    """After a power cut the checkpoints (fsynced) can be ahead of metrics.jsonl (appended, not fsynced each round):
    the resume goes back to a checkpoint its metrics cover and ends with the metrics of an uninterrupted run."""
    out = _cut(tmp_path, 2)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:1]))  # rounds 1 and 2 lost, their checkpoints kept
    assert cli("run", "--no-progress", "--resume", str(out))[0] == 0
    assert metrics(out) == reference


@pytest.mark.parametrize("damage", [b"", b"garbage, not a checkpoint", "truncated"])
def test_corrupt_or_empty_latest_checkpoint_falls_back_to_the_previous(damage, tmp_path, reference):
    out = _cut(tmp_path, 2)
    latest = out / "checkpoints" / "round_00002.pt"
    good = latest.read_bytes()
    latest.write_bytes(good[: len(good) // 2] if damage == "truncated" else damage)
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0 and "round_00002.pt" in err and "set aside" in err
    assert metrics(out) == reference
    assert (out / "checkpoints" / "round_00002.pt.corrupt").exists()  # set aside, not deleted


def test_leftover_temporary_files_are_removed(tmp_path, reference):
    """Only the names ``atomic_write`` makes (hidden, the target's name, mkstemp's 8 random characters): a
    user's own ``*.tmp`` beside the run is kept."""
    out = _cut(tmp_path, 1)
    junk = [out / ".metrics.jsonl.abc12_xy.tmp", out / "checkpoints" / ".round_00002.pt.q1w2e3r4.tmp"]
    mine = [out / "notes.tmp", out / ".notes.tmp", out / ".notes.abc.tmp", out / "checkpoints" / "mine.tmp"]
    for p in junk + mine:
        p.write_bytes(b"half")
    assert cli("run", "--no-progress", "--resume", str(out))[0] == 0
    assert not any(p.exists() for p in junk) and all(p.read_bytes() == b"half" for p in mine)
    assert metrics(out) == reference


def test_check_deletes_no_tmp_file_of_the_user(tmp_path):
    """``run --check`` writes nothing: a folder that holds a user's hidden ``.notes.tmp`` is not the leftover
    of a killed claim, it is not empty."""
    out = tmp_path / "r"
    out.mkdir()
    (out / ".notes.tmp").write_text("mine")
    rc, err = cli("run", str(write_cfg(tmp_path)), "--check", "--out", str(out))
    assert rc == 2 and "already exists" in error_line(err)
    assert (out / ".notes.tmp").read_text() == "mine"


def test_a_checkpoint_reaches_the_disk_before_its_name_and_its_name_after(tmp_path, monkeypatch):
    """A power cut (not a kill -9, which the page cache survives) after a checkpoint is written must not leave an
    empty file under the new name: its bytes are fsynced before the rename, the folder's entry after it."""
    import fedmosaic.files as files
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        real_fsync(fd)

    def replace(a, b):
        events.append(("replace", str(b), None))
        real_replace(a, b)

    monkeypatch.setattr(files.os, "fsync", fsync)
    monkeypatch.setattr(files.os, "replace", replace)
    out = tmp_path / "r"
    assert cli("run", str(write_cfg(tmp_path, train__rounds=1)), "--no-progress", "--out", str(out))[0] == 0
    (ck,) = (out / "checkpoints").glob("round_*.pt")
    i = next(i for i, e in enumerate(events) if e[:2] == ("replace", str(ck)))
    assert events[i - 1][0] == "fsync" and events[i - 1][1].startswith(str(out / "checkpoints" / f".{ck.name}."))
    assert events[i - 1][2] == ck.stat().st_size > 0  # the whole file, not a part of it
    assert events[i + 1][:2] == ("fsync", str(out / "checkpoints"))


def test_run_files_get_ordinary_permissions(tmp_path):
    out = tmp_path / "r"
    assert cli("run", str(write_cfg(tmp_path, train__rounds=2)), "--no-progress", "--out", str(out))[0] == 0
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    assert {"config.yaml", "meta.json", "metrics.jsonl", "summary.json", "learning_curves.png",
            "checkpoints/round_00001.pt"} <= modes.keys()
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_divergence_then_resume_with_a_smaller_learning_rate(tmp_path):
    out = tmp_path / "r"
    _cut(tmp_path, 1).rename(out)  # two good rounds
    # the learning rate is raised (allowed with --amend) until the run diverges in round 2
    rc, err = cli("run", "--no-progress", "--resume", str(out), "--amend", "--set", "train.optimizer.lr=1.0e+30")
    line = error_line(err)
    assert rc == 2 and "non-finite" in line and "stopped after round 1" in line
    assert f"fedmosaic run --resume {out} --amend --set train.optimizer.lr=1.0e+29" in line
    assert len(read_metrics(out)) == 2
    # a plain resume with another learning rate is refused: the config differs
    rc, err = cli("run", "--no-progress", "--resume", str(out), "--set", "train.optimizer.lr=0.01")
    assert rc == 2 and "add --amend" in error_line(err)
    # what shaped the finished rounds cannot be amended
    rc, err = cli("run", "--no-progress", "--resume", str(out), "--amend", "--set", "model.options.hidden=9")
    line = error_line(err)
    assert rc == 2 and "model.options.hidden differs" in line and "cannot change in the middle of a run" in line
    assert cli("run", "--no-progress", "--resume", str(out), "--amend", "--set", "train.optimizer.lr=0.01")[0] == 0
    assert [r["round"] for r in read_metrics(out)] == [0, 1, 2, 3]
    assert [r["lr"] for r in read_metrics(out)] == [0.05, 0.05, 0.01, 0.01]
    amendments = json.loads((out / "meta.json").read_text())["amendments"]
    assert [(a["from_round"], a["changes"]) for a in amendments] == [
        (2, {"train.optimizer.lr": [0.05, 1e30]}), (2, {"train.optimizer.lr": [1e30, 0.01]})]
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["optimizer"]["lr"] == 0.01


def test_amend_needs_resume(tmp_path):
    rc, err = cli("run", str(write_cfg(tmp_path)), "--no-progress", "--amend")
    assert rc == 2 and "--amend: only with --resume" in error_line(err)


# ---- 5. signals ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signals_name_the_real_run_directory(sig, code, tmp_path):
    cfg = write_cfg(tmp_path, train__rounds=100000, checkpoint_every=5)
    runs = tmp_path / "runs"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "fedmosaic.cli.main", "run", str(cfg), "--no-progress",
                             "--runs-dir", str(runs)], stderr=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        deadline = time.time() + 120
        while not [p for p in runs.glob("*/metrics.jsonl") if p.stat().st_size] and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    err = err.decode()
    [out] = runs.iterdir()
    assert proc.returncode == code, err
    assert f"fedmosaic: error: interrupted by {sig.name}" in error_line(err)
    assert f"fedmosaic run --resume {out}" in err
    done = len(read_metrics(out))
    assert done >= 1
    assert "stopping after this round" in err
    assert latest_checkpoint(out).name == f"round_{done - 1:05d}.pt"  # the interrupted round finished and is saved
    # what the message says works: the run continues from its last checkpoint
    rc, _ = cli("run", "--no-progress", "--resume", str(out), "--amend", "--set", f"train.rounds={done + 1}")
    assert rc == 0 and len(read_metrics(out)) == done + 1


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, changes", [
    (signal.SIGTERM, 143, {"algorithm": {"name": "fedpac", "head_epochs": 10000}}),
    (signal.SIGINT, 130, {"algorithm": {"name": "ahf", "public_epochs": 1000},
                          "data__public": {"source": "noise", "size": 2000}}),
    (signal.SIGTERM, 143, {"train__local_epochs": 100000}),  # auto compiles this one: its compile is cut short too
    (signal.SIGINT, 130, {"train__local_epochs": 100000,  # a comparison over seeds: nothing of it is left either
                          "compare": [{"name": "fedavg"}, {"name": "fedprox", "mu": 0.1}], "seeds": [0, 1]}),
])
def test_one_signal_stops_a_long_round_within_a_step_after_its_grace(sig, code, changes, tmp_path):
    """A round of hours (10,000 head epochs, 1,000 epochs on the public stream, 100,000 local epochs) is not
    waited for: a single signal lets it go on for stopping.GRACE_S seconds, then it stops at its next step (or,
    busy compiling its graphs from a cold compile cache, a second later), unfinished, with the one-line
    interruption (no second signal from outside, no SIGKILL)."""
    from fedmosaic.engine.stopping import GRACE_S

    cfg = write_cfg(tmp_path, **changes)
    runs = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "fedmosaic.cli.main", "run", str(cfg), "--no-progress",
                             "--runs-dir", str(runs)], stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while not list(runs.glob("**/meta.json")) and time.monotonic() < deadline:  # round 0 has begun
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(sig)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=GRACE_S + 60)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    err = err.decode()
    assert proc.returncode == code, err[-2000:]
    assert f"if it takes more than {GRACE_S:g} s, at its next step" in err
    assert f"fedmosaic: error: interrupted by {sig.name}" in error_line(err)
    assert GRACE_S <= took < GRACE_S + 30, took  # (30 s: a busy machine's step, never the round's hours)
    assert not runs.exists()  # a new run stopped in round 0 leaves nothing behind (README), no --runs-dir


def test_a_hand_edited_config_yaml_is_a_change_like_a_set(tmp_path, reference):
    """The resume compares ``config.yaml`` with the config the run recorded (``meta.json``), not with itself:
    an edit is refused without ``--amend`` (nothing changes), recorded with it; a run recorded before
    meta.json held its config resumes as before."""
    out = _cut(tmp_path, 1)
    saved = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(saved.replace("lr: 0.05", "lr: 0.5"))
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    line = error_line(err)
    assert rc == 2 and "train.optimizer.lr: 0.05 -> 0.5" in line and "meta.json" in line and "--amend" in line
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    (out / "config.yaml").write_text(saved.replace("hidden: 8", "hidden: 9"))
    rc, err = cli("run", "--no-progress", "--resume", str(out), "--amend")
    assert rc == 2 and "model.options.hidden differs" in error_line(err)
    (out / "config.yaml").write_text(saved.replace("lr: 0.05", "lr: 0.01"))
    assert cli("run", "--no-progress", "--resume", str(out), "--amend")[0] == 0
    meta = json.loads((out / "meta.json").read_text())
    assert [a["changes"] for a in meta["amendments"]] == [{"train.optimizer.lr": [0.05, 0.01]}]
    assert [r["lr"] for r in read_metrics(out)] == [0.05, 0.05, 0.01, 0.01]
    (tmp_path / "old").mkdir()
    old = _cut(tmp_path / "old", 1)
    meta = json.loads((old / "meta.json").read_text())
    del meta["config"]
    (old / "meta.json").write_text(json.dumps(meta))
    assert cli("run", "--no-progress", "--resume", str(old))[0] == 0
    assert metrics(old) == reference


def test_an_amended_run_without_the_checkpoints_after_its_amendment_is_not_recomputed_from_before_it(tmp_path):
    """A finished run's checkpoints may be deleted to save disk; extending it then started again from round 0 with
    the amended config (here lr 0.01 from round 2), recomputing rounds 0-1 over their recorded metrics with the
    later learning rate, and meta.json still said the change began at round 2. Now refused in one line, nothing
    touched."""
    import shutil

    out = _cut(tmp_path, 1)
    assert cli("run", "--no-progress", "--resume", str(out), "--amend", "--set", "train.optimizer.lr=0.01")[0] == 0
    shutil.rmtree(out / "checkpoints")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    rc, err = cli("run", "--no-progress", "--resume", str(out), "--amend", "--set", "train.rounds=6")
    line = error_line(err)
    assert rc == 2 and "amended from round 2" in line and "rounds 0-1 would be recomputed" in line, line
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_damaged_meta_json_does_not_let_an_edited_config_through(tmp_path):
    """meta.json holds the config a resume checks config.yaml against: damaged, an edit (lr 0.05 -> 0.5) went
    unnoticed. Now a plain resume is refused in one line; --amend takes config.yaml as it is (below)."""
    out = _cut(tmp_path, 1)
    (out / "meta.json").write_text("garbage")
    (out / "config.yaml").write_text((out / "config.yaml").read_text().replace("lr: 0.05", "lr: 0.5"))
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    line = error_line(err)
    assert rc == 2 and "meta.json is damaged" in line and "--amend" in line, line
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_check_on_a_resume_refuses_what_the_resume_would(tmp_path):
    """``--check`` said ok for resumes the run then refused: a change without --amend, one --amend cannot make."""
    out = _cut(tmp_path, 1)
    for extra, needle in ((["--set", "train.optimizer.lr=0.9"], "add --amend"),
                          (["--amend", "--set", "seed=4"], "cannot change in the middle of a run")):
        rc, err = cli("run", "--resume", str(out), "--check", *extra)
        assert rc == 2 and needle in error_line(err), err
    assert cli("run", "--resume", str(out), "--check", "--amend", "--set", "train.optimizer.lr=0.9")[0] == 0
    assert json.loads((out / "meta.json").read_text()).get("amendments") is None  # (a check writes nothing)


def test_amend_with_a_damaged_meta_json_and_report_of_it(tmp_path):
    out = _cut(tmp_path, 1)
    (out / "meta.json").write_text('{"truncated": ')
    rc, err = cli("run", "--no-progress", "--resume", str(out), "--amend", "--set", "train.optimizer.lr=0.01")
    assert rc == 0 and "meta.json is missing or damaged" in err
    assert (out / "meta.json.corrupt").read_text() == '{"truncated": '  # kept, not overwritten
    assert json.loads((out / "meta.json").read_text())["amendments"][0]["changes"] == {
        "train.optimizer.lr": [0.05, 0.01]}
    (out / "meta.json").write_text("[]")
    rc, err = cli("report", str(out))
    assert rc == 0 and "meta.json is missing or damaged" in err
    for damaged, lr in (("null", 0.02), ("[1]", 0.03)):  # JSON, not the object the runner writes: damaged, no bug
        (out / "meta.json.corrupt").unlink(missing_ok=True)
        (out / "meta.json").write_text(damaged)
        rc, err = cli("run", "--no-progress", "--resume", str(out), "--amend", "--set", f"train.optimizer.lr={lr}")
        assert rc == 0 and "meta.json is missing or damaged" in err, err
        assert (out / "meta.json.corrupt").read_text() == damaged
    (out / "meta.json").write_text("7")  # damaged again: the file set aside before stays as it was
    rc, err = cli("run", "--no-progress", "--resume", str(out), "--amend", "--set", "train.optimizer.lr=0.04")
    assert rc == 0 and (out / "meta.json.corrupt").read_text() == "[1]"
    assert (out / "meta.json.corrupt.1").read_text() == "7"


def test_what_is_set_aside_never_replaces_what_was_set_aside_before(tmp_path):
    from fedmosaic.files import set_aside

    for text in ("first", "second", "third"):
        (tmp_path / "round_00002.pt").write_text(text)
        set_aside(tmp_path / "round_00002.pt", ".corrupt")
        set_aside(tmp_path / "metrics.jsonl.20261202-101010", ".bak", text.encode())  # (the same second)
    assert [(tmp_path / f"round_00002.pt.corrupt{s}").read_text() for s in ("", ".1", ".2")] == \
        ["first", "second", "third"]
    assert [(tmp_path / f"metrics.jsonl.20261202-101010.bak{s}").read_text() for s in ("", ".1", ".2")] == \
        ["first", "second", "third"]
    assert not (tmp_path / "round_00002.pt").exists()


def test_runs_started_together_get_their_own_directories(tmp_path):
    from fedmosaic.runs.dirs import claim, new_run_dir

    made = [new_run_dir(tmp_path / "runs", "same") for _ in range(3)]  # within one second: same time stamp
    assert len(set(made)) == 3 and all(p.is_dir() for p in made)
    claim(made[0] / "config.yaml", "first")
    with pytest.raises(FedMosaicError, match="taken by another run meanwhile"):
        claim(made[0] / "config.yaml", "second")  # two runs given the same --out
    assert (made[0] / "config.yaml").read_text() == "first"


def test_a_failed_start_leaves_no_reserved_directory(tmp_path):
    rc, err = cli("run", str(write_cfg(tmp_path, model={"name": "cnn4"})), "--no-progress", "--runs-dir",
                  str(tmp_path / "runs"))
    assert rc == 2 and "too small" in error_line(err)
    assert not (tmp_path / "runs").exists()  # made for it: removed too


def test_a_failed_start_leaves_no_folder_it_made_and_keeps_those_that_were_there(tmp_path):
    """The data are not found, or round 0 diverges: every folder the command made for the run (its --out and
    the parents made for it, its --runs-dir) is removed; a folder that was there before stays."""
    cfg, empty, kept = str(write_cfg(tmp_path)), tmp_path / "no data", tmp_path / "kept"
    empty.mkdir()
    kept.mkdir()
    for argv in (["--runs-dir", str(tmp_path / "new" / "runs")], ["--out", str(tmp_path / "a" / "b")],
                 ["--out", str(tmp_path / "s" / "t"), "--seeds", "1", "2"], ["--runs-dir", str(kept)],
                 ["--out", str(kept), "--seeds", "1"], ["--out", str(kept / "x" / "y")]):
        rc, err = cli("run", cfg, "--no-progress", "--data-dir", str(empty), "--set", "data.dataset=mnist",
                      *argv)
        assert rc == 2 and "not found" in error_line(err), argv
    rc, err = cli("run", cfg, "--no-progress", "--out", str(tmp_path / "d" / "e"), "--set",
                  "train.optimizer.lr=1.0e+30")
    assert rc == 2 and "in the first round" in error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml", "kept", "no data"]
    assert kept.is_dir() and not any(kept.iterdir())


def test_resume_without_checkpoints_keeps_the_metrics_it_recomputes(tmp_path, reference):
    out = _cut(tmp_path, 2)
    before = (out / "metrics.jsonl").read_text()
    for ck in (out / "checkpoints").iterdir():
        ck.unlink()
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0 and "have metrics but no usable checkpoint" in err
    [backup] = out.glob("metrics.jsonl.*.bak")
    assert backup.read_text() == before
    assert metrics(out) == reference


def test_a_finished_run_without_its_checkpoints_is_finished(tmp_path, reference):
    """Checkpoints removed after the run ended (to save disk, or the run directory kept without them): resuming
    it recomputes nothing and keeps its metrics; with more rounds (--amend) there is no state to go on from, so
    it starts again, keeping the old metrics aside."""
    out = tmp_path / "done"
    assert cli("run", str(write_cfg(tmp_path)), "--no-progress", "--out", str(out))[0] == 0
    before = (out / "metrics.jsonl").read_text()
    shutil.rmtree(out / "checkpoints")
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0 and "checkpoint" not in err
    assert (out / "metrics.jsonl").read_text() == before and not (out / "checkpoints").exists()
    assert metrics(out) == reference
    rc, err = cli("run", "--no-progress", "--resume", str(out), "--amend", "--set", "train.rounds=5")
    assert rc == 0 and "have metrics but no usable checkpoint" in err
    assert len(read_metrics(out)) == 5 and metrics(out)[:4] == reference
    [backup] = out.glob("metrics.jsonl.*.bak")
    assert backup.read_text() == before


def test_amend_cannot_cut_finished_rounds(tmp_path):
    out = _cut(tmp_path, 2)
    rc, err = cli("run", "--no-progress", "--resume", str(out), "--amend", "--set", "train.rounds=2")
    assert rc == 2 and "train.rounds must be >= the 3 rounds already finished" in error_line(err)
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["rounds"] == 4


def test_metrics_lines_that_summaries_cannot_read_count_as_damaged(tmp_path, reference):
    out = _cut(tmp_path, 2)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join([lines[0], '{"round": 1}', lines[2]]) + "\n")
    rc, err = cli("report", str(out))
    assert rc == 0 and "line 2 is damaged" in err
    assert cli("run", "--no-progress", "--resume", str(out))[0] == 0
    assert metrics(out) == reference


def test_a_checkpoint_of_another_run_is_set_aside(tmp_path, reference):
    from fedmosaic.config import load_config
    from fedmosaic.runs.runner import run

    out = _cut(tmp_path, 2)
    other = tmp_path / "other"
    run(load_config(write_cfg(tmp_path, seed=2)), other, progress=False, stop_after=2)
    (out / "checkpoints" / "round_00002.pt").write_bytes((other / "checkpoints" / "round_00002.pt").read_bytes())
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0 and "written by another run" in err
    assert metrics(out) == reference


def test_a_run_whose_checkpoints_are_all_of_another_run_is_not_restarted_under_its_old_metrics(tmp_path):
    """What a resume sees when the data or a plug-in's model changed since the run was made: every checkpoint
    loads but is another run's. Starting again from round 0 would recompute it on something else (and drop its
    metrics); it is refused in one line and nothing in the directory changes."""
    from fedmosaic.config import load_config
    from fedmosaic.runs.runner import run

    out, other = tmp_path / "cut", tmp_path / "other"
    for where, seed in ((out, 1), (other, 2)):
        run(load_config(write_cfg(tmp_path, seed=seed)), where, progress=False, stop_after=2)
    for ck in (out / "checkpoints").glob("round_*.pt"):
        ck.write_bytes((other / "checkpoints" / ck.name).read_bytes())
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 2 and "cannot resume: its checkpoints were written by another run (seed" in error_line(err)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_checkpoint_without_its_run_identity_is_not_this_runs(tmp_path, reference):
    """Every format-2 checkpoint is written with its seed, partition and config hash: one without them (or
    without one of them) is set aside, and where no other is usable the resume is refused in one line naming
    it. A format-1 checkpoint written before there was an identity still resumes (tests/engine: earlier
    format)."""
    out = _cut(tmp_path, 2)
    newest, before_it = (out / "checkpoints" / f"round_0000{r}.pt" for r in (2, 1))
    state = torch.load(newest, weights_only=True)
    torch.save({k: v for k, v in state.items() if k != "run"}, newest)
    state = torch.load(before_it, weights_only=True)
    torch.save({**state, "run": {k: v for k, v in state["run"].items() if k != "config"}}, before_it)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    line = error_line(err)
    assert rc == 2 and "written without a run identity (no seed, data_hash, config)" in line, line
    assert "checkpoints/round_00002.pt the newest" in line and "altered or made elsewhere" in line
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    (tmp_path / "one").mkdir()  # only the newest without it: the one before is used
    out = _cut(tmp_path / "one", 2)
    ck = out / "checkpoints" / "round_00002.pt"
    state = torch.load(ck, weights_only=True)
    torch.save({k: v for k, v in state.items() if k != "run"}, ck)
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0 and "round_00002.pt: written without a run identity" in err and "set aside" in err
    assert metrics(out) == reference
    (tmp_path / "old").mkdir()  # format 1, from before checkpoints carried an identity
    out = _cut(tmp_path / "old", 2)
    state = torch.load(ck := out / "checkpoints" / "round_00002.pt", weights_only=True)
    old = {k: v for k, v in state.items() if k not in ("format", "clients", "server_buffers", "run")}
    old["stores"] = [c["store"] for c in state["clients"]]
    old["buffers"] = [(c["buffers"], gb, c["task_buffers"])
                      for c, gb in zip(state["clients"], state["server_buffers"], strict=True)]
    torch.save(old, ck)
    rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0 and "set aside" not in err and metrics(out) == reference


def test_report_of_a_comparison_directory_lists_its_variants(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert cli("run", str(write_cfg(tmp_path, train__rounds=1)), "--no-progress", "--out", str(out),
               "--set", "compare=[{name: fedavg}, {name: fedprox, mu: 0.1}]")[0] == 0
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    summary, terms = capsys.readouterr().out.split("\n\n")
    assert [ln.split()[0] for ln in summary.splitlines()[2:]] == ["fedavg", "fedprox(mu=0.1)"]
    rows = {ln.split()[0]: ln.split()[1:] for ln in terms.splitlines()[2:]}
    assert rows["fedavg"] == ["-", "-"] and len(rows["fedprox(mu=0.1)"]) == 2  # FedAvg has one term: none named


def test_interrupting_any_command_is_one_line(monkeypatch, capsys):
    import fedmosaic.cli.main as cli_main

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "_partition", interrupted)
    assert main(["partition", "--dataset", "digits", "--clients", "3"]) == 130
    assert capsys.readouterr().err == "fedmosaic: error: interrupted by SIGINT; nothing is left half-written\n"


def test_empty_data_dir_is_an_error(capsys):
    assert main(["--data-dir", "", "data", "list"]) == 2
    assert capsys.readouterr().err == "fedmosaic: error: --data-dir: must name at least one folder\n"


def test_eval_start_records_the_untrained_model_and_a_mean_from_it_that_survives_a_resume(tmp_path):
    """``eval.start``: the model before any training is judged once (the FedProx framework's round 0, from which
    the APFL-PD paper's means count), in round 0's line; the summary's mean from the start counts it beside every
    evaluation; a run killed after round 1 resumes to the same lines."""
    from fedmosaic.config import load_config
    from fedmosaic.runs.records import summarize
    from fedmosaic.setup.world import build_federation

    cfg = write_cfg(tmp_path, eval={"start": True}, algorithm={"name": "ditto"})
    full = tmp_path / "full"
    assert cli("run", str(cfg), "--no-progress", "--out", str(full))[0] == 0
    recs = read_metrics(full)
    assert "start" in recs[0] and all("start" not in r for r in recs[1:])
    untrained = build_federation(load_config(cfg)).evaluate(0)  # (a fresh federation: the seed's initial model)
    for key in ("global", "global_clients", "personal"):
        assert recs[0]["start"][key]["acc"] == untrained[key]["acc"] != recs[0][key]["acc"]
    summary = json.loads((full / "summary.json").read_text())
    want = np.mean([untrained["personal"]["acc"], *(r["personal"]["acc"] for r in recs)])
    assert summary["personal_acc_mean_from_start"] == pytest.approx(want)
    assert summarize(recs[1:], load_config(cfg)).get("personal_acc_mean_from_start") is None  # (no start: none)
    for keep in (2, 0):  # a run killed after round 1, or in round 0 (its start judged again)
        cut = tmp_path / f"cut{keep}"
        shutil.copytree(full, cut)
        lines = (cut / "metrics.jsonl").read_text().splitlines(keepends=True)
        (cut / "metrics.jsonl").write_text("".join(lines[:keep]))
        for ck in (cut / "checkpoints").iterdir():
            if int(ck.stem.split("_")[1]) >= keep - 1:
                ck.unlink()
        (cut / "summary.json").unlink()
        assert cli("run", "--no-progress", "--resume", str(cut))[0] == 0
        assert metrics(cut) == metrics(full)


def test_eval_start_with_a_task_stream_is_refused_in_one_line(tmp_path):
    cfg = write_cfg(tmp_path, eval={"start": True}, algorithm={"name": "fedlwf"},
                    data__tasks={"n_tasks": 2, "rounds_per_task": 2})
    rc, err = cli("run", str(cfg), "--no-progress", "--out", str(tmp_path / "x"))
    assert rc == 2 and "eval.start: a task stream" in error_line(err) and not (tmp_path / "x").exists()
