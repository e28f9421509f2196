"""A stop asked by a signal, seen by the step loops: a round that has not ended ``GRACE_S`` seconds after Ctrl-C or
SIGTERM stops at its next training step, unfinished (a resume repeats it from the last checkpoint), so that one
signal ends even a round of hours within a step. The runner arms it (``runs.signals.stop_between_rounds``); the step
loops call :func:`check`, which costs one comparison while nothing was asked."""

from __future__ import annotations

import time
from collections.abc import Callable

#: how long a round may go on after the first signal to finish and be saved (supervisors wait 10 s or more before
#: SIGKILL: docker 10, Kubernetes 30, systemd 90)
GRACE_S = 5.0

_deadline = float("inf")
_stop: Callable[[], None] | None = None


def arm(stop: Callable[[], None], grace_s: float = GRACE_S) -> None:
    """From now on, a step that starts ``grace_s`` seconds later calls ``stop`` (which raises)."""
    global _deadline, _stop
    _deadline, _stop = time.monotonic() + grace_s, stop


def disarm() -> None:
    global _deadline, _stop
    _deadline, _stop = float("inf"), None


def check() -> None:
    """Called before every training step."""
    if _stop is not None and time.monotonic() >= _deadline:
        stop = _stop
        disarm()
        stop()
