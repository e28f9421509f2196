"""The process's CPU threads, chosen once before anything runs.

The process's CPU threads (:func:`cpu_threads`, applied before anything runs) never oversubscribe: unless
``engine.threads`` or ``OMP_NUM_THREADS`` says how many, they follow the cores this process may use (its CPU
affinity, a cgroup CPU quota), its share of them when ``FEDMOSAIC_PARALLEL_RUNS`` runs share the machine, and the
cores other processes keep busy when it starts. A thread that waits for a core makes every parallel operation
wait for it: beside one busy core, two threads on a 2-core machine ran a run ~8x slower than one.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ...errors import ConfigError

#: ``FEDMOSAIC_PARALLEL_RUNS=N``: N runs share this machine's cores; each takes 1/N of them by default
PARALLEL_RUNS = "FEDMOSAIC_PARALLEL_RUNS"
#: how long the start of a process watches what the other processes keep busy (once per process)
BUSY_SAMPLE_S = 0.25
#: a cgroup's CPU quota and period: cgroup v2 (one file), v1 (two)
CGROUP_QUOTA = (("/sys/fs/cgroup/cpu.max",), ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"))

#: the most torch threads a run takes (engine.threads' bound, and OMP_NUM_THREADS')
MAX_THREADS = 1024


@dataclass(frozen=True)
class Threads:
    """torch's intra-op threads for this process, and why."""

    count: int
    why: str

    def __str__(self) -> str:
        return f"{self.count} CPU thread{'s' if self.count > 1 else ''} ({self.why})"


def thread_count(cores: int, runs: int = 1, busy: float = 0.0) -> int:
    """Threads that do not oversubscribe: this run's share of the ``cores`` it may use when ``runs`` runs share
    them, and no more than the cores left free by what other processes keep ``busy`` (a half-busy core counts free)."""
    return max(1, min(cores // runs, math.floor(cores - busy + 0.5)))


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, cpusets), capped by a cgroup CPU quota (a
    container's ``--cpus``)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    for files in CGROUP_QUOTA:
        try:
            quota, period = " ".join(Path(f).read_text() for f in files).split()[:2]
            if quota not in ("max", "-1"):  # no quota
                cores = min(cores, max(1, int(quota) // int(period)))
        except (OSError, ValueError):
            continue
    return cores


def _cpu_ticks(cpus: set[int]) -> tuple[int, int]:
    """(busy, total) clock ticks of ``cpus`` since boot (``/proc/stat``); busy is time spent on work at normal
    priority (user, system, interrupts, and time the hypervisor took): niced work yields its core to a run."""
    busy = total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *ticks = line.split()
            if name[3:].isdigit() and name.startswith("cpu") and int(name[3:]) in cpus:
                user, nice, system, idle, iowait, irq, softirq, steal = map(int, ticks[:8])
                busy += user + system + irq + softirq + steal
                total += user + nice + system + idle + iowait + irq + softirq + steal
    return busy, total


@cache
def busy_cores(seconds: float = BUSY_SAMPLE_S) -> float:
    """How many of this process's cores other processes keep busy, watched for ``seconds`` while this one sleeps
    (once per process: a run's thread count, and so its last float bits, stays fixed); 0 where ``/proc/stat`` is
    not there (not Linux)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    try:
        b0, t0 = _cpu_ticks(cpus)
        time.sleep(seconds)
        b1, t1 = _cpu_ticks(cpus)
    except (OSError, ValueError):
        return 0.0
    return len(cpus) * (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


def omp_threads() -> int | None:
    """``OMP_NUM_THREADS`` as a thread count, None where it is unset; one line where it is not one (OpenMP ignores
    0 or text with a line of its own, and a count like 100000 crashed the process without a word). The CLI asks
    before torch is imported."""
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not omp:
        return None
    if not (omp.isdigit() and 0 < int(omp) <= MAX_THREADS):
        raise ConfigError(f"OMP_NUM_THREADS: a thread count in [1, {MAX_THREADS}] (got {omp[:20]!r}); unset it to "
                          "let fedmosaic choose")
    return int(omp)


def cpu_threads(configured: int | None, recorded: int | None = None) -> Threads:
    """The process's torch threads: ``engine.threads`` if set, else ``OMP_NUM_THREADS`` if set (both kept as they
    are), else those a resumed run ``recorded`` when it started (the thread count changes a sum's last bits, so a
    resumed run keeps it), else :func:`thread_count` of the usable cores, ``FEDMOSAIC_PARALLEL_RUNS`` and the cores
    busy now."""
    if configured:
        return Threads(configured, "engine.threads")
    omp = omp_threads()
    if omp is not None:
        if recorded and omp != recorded:
            warnings.warn(f"OMP_NUM_THREADS={omp}, where the run started with {recorded} thread"
                          f"{'s' if recorded > 1 else ''}: a sum's last bits, and so the rest of the run, may differ "
                          "from an uninterrupted run's; unset it to keep the recorded count", stacklevel=2)
        return Threads(omp, "OMP_NUM_THREADS")
    if recorded:
        return Threads(recorded, "as when the run started")
    text = os.environ.get(PARALLEL_RUNS, "1").strip() or "1"
    if not (text.isdigit() and int(text) > 0):
        raise ConfigError(f"{PARALLEL_RUNS}: the number of runs sharing this machine, a positive integer (got "
                          f"{text!r}); unset it for one")
    runs, cores, busy = int(text), usable_cores(), busy_cores()
    why = f"{cores} usable core{'s' if cores > 1 else ''}"
    if runs > 1:
        why += f" shared by {runs} runs ({PARALLEL_RUNS})"
    if busy >= 0.05:
        why += f", {busy:.1f} kept busy by other processes"
    return Threads(thread_count(cores, runs, busy), why)
