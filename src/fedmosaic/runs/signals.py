"""Stopping between rounds on Ctrl-C or SIGTERM (the round finishes and is saved), and the progress bar."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from ..engine import stopping


class _Stop:
    def __init__(self):
        self.asked: int | None = None  # the signal that asked to stop
        self.handlers: dict = {}  # the handlers in place before the run, by signal
        self.timer: threading.Timer | None = None  # the signal again, once the grace is over

    def now(self) -> None:
        if self.asked is not None:
            if self.timer is not None:  # the round ended within its grace: no signal again
                self.timer.cancel()
            _raise_as(self.handlers[self.asked], self.asked)


def _raise_as(handler, signum: int) -> None:
    """What the handler in place before the run would have done (the CLI's: unwind as an interrupt)."""
    if callable(handler):
        handler(signum, None)
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_between_rounds():
    """Ctrl-C or SIGTERM during a round lets the round finish and be saved (checkpoint included), then stops, so a
    resume continues from there; a round not done ``stopping.GRACE_S`` seconds later stops at its next training
    step, unfinished, and so does a second signal at once (a resume then repeats the rounds since the last
    checkpoint). A round busy where no step looks (compiling its graphs: a cold compile takes minutes) is stopped a
    second after the grace all the same: the run sends itself the signal again. Outside the main thread signals
    are left alone."""
    stop = _Stop()

    def handler(signum, frame):
        if stop.asked is not None:
            _raise_as(stop.handlers[signum], signum)
        stop.asked = signum
        stopping.arm(lambda: _raise_as(stop.handlers[signum], signum))
        stop.timer = threading.Timer(stopping.GRACE_S + 1.0, os.kill, (os.getpid(), signum))
        stop.timer.daemon = True
        stop.timer.start()
        print(f"\nfedmosaic: note: {signal.Signals(signum).name}: stopping after this round, once it is saved; "
              f"if it takes more than {stopping.GRACE_S:g} s, at its next step, unfinished (again to stop now)",
              file=sys.stderr, flush=True)

    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            stop.handlers[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread
        pass
    try:
        yield stop
    finally:
        stopping.disarm()
        if stop.timer is not None:
            stop.timer.cancel()
        for sig, previous in stop.handlers.items():
            signal.signal(sig, previous)


def postfix(rec: dict) -> dict:
    post = {"loss": f"{rec['train_loss']:.3f}"}
    for key in ("global", "personal"):
        if key in rec:
            post[f"acc_{key[0]}"] = f"{rec[key]['acc']:.3f}"
    return post


def progress_bar(it, name, enabled, start, total):
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=name, initial=start, total=total, unit="round", dynamic_ncols=True)


