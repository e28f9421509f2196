"""The scale-out tests' helpers: the environment of every Ray process they start (no usage statistics, no token
file written into the home directory), the processes below a PID, the configs. The session's Ray runtime is the
``ray_runtime`` fixture of tests/conftest.py."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

#: for the runtime started here and every process (CLI driver, `ray start`) a test starts
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
#: 5 clients over 2 actors (3 + 2), 4 of them per round: cohorts that leave clients out, shards of unequal size
SHARDED = {"data": {"clients": 5}, "train": {"clients_per_round": 4, "rounds": 3}}


def descendants(*pids: int) -> list[int]:
    """Every process below ``pids`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], list(pids)
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` (a process started in a session of its own and everything it started,
    also what outlived it: a `ray start --block`'s raylet, a driver's Ray workers)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(d.name)) == sid:
                    out.append(int(d.name))
    return out


def kill(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def cfg_of(family: str, backend: str = "sequential", ray: dict | None = None, engine: dict | None = None, **over):
    """``family``'s config (``deploy.cases``) over 5 clients — 2 actors of half a CPU host 3 and 2 of them — 4 per
    round (cohorts that leave clients out)."""
    from deploy.cases import config
    from fedtest import merged

    engine = {"backend": backend, "threads": 1, "ray": {"actors": 2, "cpus_per_actor": 0.5, **(ray or {})},
              **(engine or {})}
    return config(family, engine=engine, **merged(SHARDED, over))
