"""A Ray runtime for the scale-out tests: one per session, local (2 CPUs, a small object store, no dashboard, no
usage statistics, no token file written into the home directory), stopped at the end, with every process it
started killed by PID."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

#: for the runtime started here and every process (CLI driver, `ray start`) a test starts
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
for _k, _v in RAY_ENV.items():
    os.environ.setdefault(_k, _v)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def ray_runtime(tmp_path_factory):
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 2**20,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))
    try:
        yield ray
    finally:
        started = set(descendants(os.getpid()))
        ray.shutdown()
        kill(started & set(descendants(os.getpid())))  # what ray.shutdown left running


@pytest.fixture(autouse=True)
def _bounded():
    """No test here runs longer than 240 s: an alarm interrupts it (Ray's waits are interruptible)."""

    def stop(signum, frame):
        raise TimeoutError("the test took more than 240 s")

    before = signal.signal(signal.SIGALRM, stop)
    signal.alarm(240)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
