"""The task calendar of a class-incremental run: which classes each client meets when. It is what the server knows
of the clients' task streams — per client the ids and classes of its tasks, in the order it meets them, and the
rounds per task — never the samples (those stay with the client's data)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TaskCalendar:
    # per client [(task id, classes)], in the order it meets them; None: no task at that stage (a shared order's task
    # the client holds no sample of: it sits the stage out)
    streams: list[list[tuple[int, np.ndarray] | None]]
    rounds_per_task: int
    num_classes: int

    def stage(self, t: int) -> int:
        """The task stage round ``t`` belongs to (the i-th task of every client's stream)."""
        return t // self.rounds_per_task

    def task_ends(self, t: int) -> bool:
        """Round ``t`` is the last of a task."""
        return (t + 1) % self.rounds_per_task == 0

    def first_met(self, stage: int) -> np.ndarray:
        """[C] the stage at which some client first met each class, up to ``stage`` (``stage + 1``: not yet)."""
        first = np.full(self.num_classes, stage + 1)
        for stream in self.streams:
            for j, task in enumerate(stream[: stage + 1]):
                if task is not None:
                    first[task[1]] = np.minimum(first[task[1]], j)
        return first

    def seen_classes(self, stage: int) -> np.ndarray:
        """[C] bool: the classes some client has met in its tasks up to ``stage`` (the federation's)."""
        return self.first_met(stage) <= stage

    def live(self, t: int) -> np.ndarray | None:
        """The clients with a task in round ``t``'s stage (one whose stream has ended, or has no task at this stage,
        drops out); None: all."""
        stage = self.stage(t)
        live = [k for k, stream in enumerate(self.streams) if stage < len(stream) and stream[stage] is not None]
        return None if len(live) == len(self.streams) else np.array(live, dtype=np.int64)
