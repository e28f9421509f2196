"""kill -9 at the moments that matter, then resume (or start again): the result equals an uninterrupted run.

Each case runs the real CLI in a child process that SIGKILLs itself at a named point — while claiming a run
directory (the config written to its temporary file, not yet linked into place), while writing a checkpoint,
between two rounds, at a comparison's switch from one variant to the next — so the directory is left exactly as a
kill -9 there leaves it (no cleanup handler runs). The child is bounded in time and killed by its PID if it hangs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_recovery import cli, metrics, reference, write_cfg  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow  # a child process (torch import) per case

# The child: patch one function so that its n-th call kills the process (SIGKILL: no handler, no cleanup), then
# run the CLI. ``link``: os.link, which claims a run directory atomically (files.atomic_write, exclusive);
# ``replace``: os.replace of a checkpoint into place; ``metrics``: the write of a round's metrics line;
# ``variant_done``: compare.run_all reading a finished variant's metrics, just before the next variant starts.
CHILD = r"""
import os, signal, sys
point, nth = sys.argv[1], int(sys.argv[2])
calls = [0]
def killing(fn, when=lambda *a, **k: True):
    def wrapper(*a, **k):
        if when(*a, **k):
            calls[0] += 1
            if calls[0] == nth:
                if point == "replace":  # the checkpoint's temporary file is complete, not yet in place
                    os.kill(os.getpid(), signal.SIGKILL)
                if point == "metrics":
                    r = fn(*a, **k)
                    os.kill(os.getpid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
        return fn(*a, **k)
    return wrapper
import fedmosaic.reports.compare as compare
if point == "link":
    os.link = killing(os.link)
elif point == "replace":
    os.replace = killing(os.replace, lambda src, dst, *a, **k: os.path.basename(str(dst)).startswith("round_"))
elif point == "metrics":
    import fedmosaic.runs.runner as runner
    runner.Federation.round = killing(runner.Federation.round)
elif point == "variant_done":
    compare.read_metrics = killing(compare.read_metrics)
from fedmosaic.cli.main import main
sys.exit(main(sys.argv[3:]))
"""


def killed(point: str, nth: int, *argv: str) -> None:
    """Run ``fedmosaic *argv`` in a child that kills itself (-9) at the ``nth`` call of ``point``."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, point, str(nth), *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, (point, nth, err.decode()[-2000:])


@pytest.mark.parametrize("point, nth", [
    ("link", 1),  # claiming the run directory
    ("replace", 2),  # writing round 1's checkpoint
    ("metrics", 3),  # round 2's metrics line written, its checkpoint not
])
def test_kill9_in_a_run_then_resume_or_start_again(point, nth, tmp_path, reference):
    cfg, out = write_cfg(tmp_path), tmp_path / "r"
    killed(point, nth, "run", str(cfg), "--no-progress", "--out", str(out))
    if point == "link":  # nothing to resume: the same command again takes the directory back
        assert not (out / "config.yaml").exists() and list(out.glob(".config.yaml.*.tmp"))
        rc, err = cli("run", str(cfg), "--no-progress", "--out", str(out))
    else:
        rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0, err
    assert metrics(out) == reference
    assert not list(out.rglob(".*.tmp"))


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cmp")
    out = tmp / "full"
    cfg = write_cfg(tmp, compare=[{"name": "fedavg"}, {"name": "fedprox", "mu": 0.5}])
    assert cli("run", str(cfg), "--no-progress", "--out", str(out))[0] == 0
    return _variants(out)


def _variants(out: Path) -> dict:
    return {d.name: metrics(d) for d in sorted(out.iterdir()) if (d / "config.yaml").exists()}


@pytest.mark.parametrize("point, nth", [
    ("link", 1),  # claiming the comparison directory
    ("link", 3),  # the variant switch: the second variant claiming its directory
    ("variant_done", 1),  # the variant switch: the first finished, the second not begun
    ("metrics", 6),  # inside the second variant
])
def test_kill9_in_a_comparison_then_resume(point, nth, tmp_path, comparison):
    cfg, out = write_cfg(tmp_path, compare=[{"name": "fedavg"}, {"name": "fedprox", "mu": 0.5}]), tmp_path / "c"
    killed(point, nth, "run", str(cfg), "--no-progress", "--out", str(out))
    if nth == 1 and point == "link":
        rc, err = cli("run", str(cfg), "--no-progress", "--out", str(out))
    else:
        rc, err = cli("run", "--no-progress", "--resume", str(out))
    assert rc == 0, err
    assert _variants(out) == comparison
    assert not list(out.rglob(".*.tmp"))


def test_a_second_process_is_refused_while_a_run_goes_on_and_not_after_it_was_killed(tmp_path):
    """`fedmosaic run --resume` on a directory whose run still goes on in another process is refused in one line
    (it used to restore the same checkpoints and write the same metrics file beside it); once that process is
    killed (-9), nothing holds the directory and the resume goes on from its last round."""
    import time

    from test_recovery import error_line

    cfg, out, log = write_cfg(tmp_path, train__rounds=100_000), tmp_path / "r", tmp_path / "child.err"
    code = "import sys; from fedmosaic.cli.main import main; sys.exit(main(sys.argv[1:]))"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", code, "run", str(cfg), "--no-progress", "--out", str(out)],
                                stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the child finished no round in 240 s"
            time.sleep(0.2)
        # the second process, bounded in time: were it not refused it would train 100,000 rounds
        second = subprocess.run([sys.executable, "-c", code, "run", "--no-progress", "--resume", str(out)],
                                capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert second.returncode == 2 and "is in use by another fedmosaic process" in error_line(second.stderr)
        assert proc.poll() is None  # the first goes on
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    done = len(metrics(out))
    rc, err = cli("run", "--no-progress", "--resume", str(out), "--amend", "--set", f"train.rounds={done + 1}")
    assert rc == 0, err
    assert len(metrics(out)) == done + 1
