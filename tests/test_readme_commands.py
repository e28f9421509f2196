"""Every command in the README's command blocks runs as written: each block is read from README.md itself, each
command is run (the `fedmosaic` CLI in this process, in a scratch folder, with the data the suite reads) or named
in ``ELSEWHERE`` with the test or the reason that covers it. A command added to the README without either fails
here, so a documented example cannot break unseen. Long runs are cut to one round of two clients (``CUT``
appended: the CLI's last `--set` wins); the placeholders a reader replaces (`my.yaml`, `runs/a`, a run to resume)
are made first.
(Issue 35; docs/*.md's blocks, hours-long reproductions, are checked without running: test_docs_commands.py.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fedmosaic.cli.main import main

README = Path(__file__).resolve().parents[1] / "README.md"
#: appended to every `run` and `compare` (the CLI's last `--set` wins): the command's shape, in seconds
CUT = ["--set", "train.rounds=1", "--set", "train.local_epochs=1", "--set", "train.clients_per_round=2"]

#: commands not run here, by their first words, and what covers them instead
ELSEWHERE = {
    "pip install": "installs packages: .ci/run runs the README's install commands on a fresh clone",
    "python -m pytest": "the test suite itself: .ci/run runs it",
    "bash deploy/commands.sh": "tests/deploy/test_flower.py runs a generated commands.sh to the end",
    "fedmosaic report deploy/run": "needs the deployed run of commands.sh: tests/deploy/test_flower.py reports it",
    "ray start": "a Ray cluster of several machines: tests/scale/test_ray_cluster.py starts one on loopback",
    "fedmosaic run quickstart --set engine.pool=ray --set engine.ray.actors=2":
        "tests/scale/test_ray_cluster.py runs it (the run whose private Ray runtime another run must not join)",
    "fedmosaic run my.yaml --set engine.pool=ray --set engine.ray.address=HEAD:6379":
        "needs that cluster: tests/scale/test_ray_cluster.py runs this command against its loopback cluster",
}


def commands(text: str) -> list[str]:
    """The commands of the ```bash blocks of ``text``: continuation lines joined, comments and blank lines out."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            cmd = " ".join(shlex.split(line, comments=True))
            if cmd:
                out.append(cmd)
    return out


def test_the_readme_has_commands_and_each_is_run_or_covered_elsewhere():
    cmds = commands(README.read_text())
    assert len(cmds) > 20
    uncovered = [c for c in cmds if not c.startswith(("fedmosaic", "export")) and
                 not any(c.startswith(k) for k in ELSEWHERE)]
    assert uncovered == [], f"README commands neither run by this test nor covered elsewhere: {uncovered}"
    stale = [k for k in ELSEWHERE if not any(c.startswith(k) for c in cmds)]
    assert stale == [], f"ELSEWHERE names commands the README no longer has: {stale}"


def prepare(tmp_path: Path) -> None:
    """The files the README's commands assume a reader has: `my.yaml` (a config with FedProx's mu), `runs/a` and
    `runs/b` (two runs), and `runs/my-20261122-101500` (a run stopped after its first round)."""
    base = ["--no-progress", "--set", "train.rounds=2", "--set", "compare=null"]
    (tmp_path / "my.yaml").write_text("name: my\nalgorithm: {name: fedprox, mu: 0.1}\ntrain: {rounds: 2}\n")
    for name in ("a", "b"):
        assert main(["run", "quickstart", "--out", f"runs/{name}", *base]) == 0
    assert main(["run", "quickstart", "--out", "runs/my-20261122-101500", *base, "--set", "checkpoint_every=1"]) == 0
    (tmp_path / "runs/my-20261122-101500/metrics.jsonl").write_text(
        (tmp_path / "runs/my-20261122-101500/metrics.jsonl").read_text().splitlines(keepends=True)[0])


@pytest.mark.slow
def test_every_readme_command_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    prepare(tmp_path)
    ran = []
    for cmd in commands(README.read_text()):
        if any(cmd.startswith(k) for k in ELSEWHERE):
            continue
        words = shlex.split(cmd)
        if words[0] == "export":  # the data path the suite already sets (conftest): nothing to change
            assert words[1].startswith("FEDMOSAIC_DATA=")
            continue
        argv = words[1:] or ["run"]  # bare `fedmosaic` runs the quickstart
        if argv[0] in ("run", "compare") and "--resume" not in argv:
            argv = [*argv, "--no-progress", *CUT]
        if argv[0] == "reproduce" and "--list" not in argv:  # one seed, every experiment cut the same way
            argv = [*argv, "--no-progress", "--seeds", "0", *CUT]
        capsys.readouterr()
        rc, err = main(argv), capsys.readouterr().err
        assert rc == 0, f"`{cmd}` exited {rc}: {err[-1500:]}"
        ran.append(cmd)
    assert len(ran) >= 11, ran
