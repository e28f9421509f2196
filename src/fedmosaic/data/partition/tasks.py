"""Class-incremental task streams for federated continual learning (ProtoFCL)."""

from __future__ import annotations

import numpy as np

from ...errors import ConfigError
from .base import Parts, as_labels, is_count, shown

Stream = list[tuple[int, np.ndarray, np.ndarray]]


def task_streams(
    labels: np.ndarray,
    parts: Parts,
    n_tasks: int,
    tasks_per_client: int | tuple[int, int] | None,
    rng: np.random.Generator,
    classes_per_task: int | None = None,
    shuffle_classes: bool = True,
) -> list[Stream]:
    """Per client, the ordered list of ``(task_id, task_classes, indices)`` it trains on.

    The label set (the distinct values in ``labels``) is cut into ``n_tasks`` disjoint groups of
    ``classes_per_task`` classes (default C / n_tasks, which must then divide C; otherwise the classes beyond
    ``n_tasks * classes_per_task`` are unused). Task t holds classes ``order[t*cpt:(t+1)*cpt]`` where
    ``order`` is a seeded permutation of the classes, or ascending order with ``shuffle_classes=False``.

    Each client then draws its own sequence: a random order of ``tasks_per_client`` (None = all) distinct
    tasks, chosen among the tasks it holds at least one sample of, so a client whose partition lacks some
    classes gets fewer tasks. A pair ``(lo, hi)`` draws each client's count uniformly from lo..hi (the paper's
    sequences of random length). ``indices`` are the client's samples (from ``parts``) of that task's classes,
    sorted; different clients may receive the same task (and hence classes), but since ``parts`` are disjoint
    no sample is shared. A client's samples of tasks it was not dealt are unused.
    """
    labels = as_labels(labels)
    counts = {"n_tasks": n_tasks, "classes_per_task": classes_per_task}
    for name, value in counts.items():
        if not (is_count(value) or (value is None and name != "n_tasks")):
            raise ConfigError(f"{name}: must be an integer (got {shown(value)})")
    classes = np.unique(labels)
    cpt = _classes_per_task(len(classes), n_tasks, classes_per_task)
    lo, hi = count_range(tasks_per_client, n_tasks)

    order = rng.permutation(classes) if shuffle_classes else classes
    used = order[: n_tasks * cpt]
    task_classes = [np.sort(used[t * cpt : (t + 1) * cpt]) for t in range(n_tasks)]
    # Task of each class by its rank among ``classes`` (label values may be sparse and large).
    task_of = np.full(len(classes), -1, dtype=np.int64)
    task_of[np.searchsorted(classes, used)] = np.repeat(np.arange(n_tasks), cpt)
    rank = np.searchsorted(classes, labels)

    streams = []
    for part in parts:
        part = np.asarray(part, dtype=np.int64)
        t_of = task_of[rank[part]]
        count = hi if lo == hi else int(rng.integers(lo, hi + 1))
        held = rng.permutation(np.unique(t_of[t_of >= 0]))[:count]
        streams.append([(int(t), task_classes[t], np.sort(part[t_of == t])) for t in held])
    return streams


def count_range(tasks_per_client, n_tasks: int) -> tuple[int, int]:
    """``tasks_per_client`` (None, a count or a pair lo, hi) as the range lo..hi inside 1..n_tasks."""
    if tasks_per_client is None:
        return n_tasks, n_tasks
    pair = tasks_per_client if isinstance(tasks_per_client, (tuple, list)) else (tasks_per_client,) * 2
    if len(pair) != 2 or not all(is_count(v) for v in pair) or not 1 <= pair[0] <= pair[1] <= n_tasks:
        raise ConfigError(f"tasks_per_client: must be a count or a pair lo <= hi, between 1 and n_tasks={n_tasks} "
                          f"(got {shown(tasks_per_client)})")
    return int(pair[0]), int(pair[1])


def _classes_per_task(n_classes: int, n_tasks: int, classes_per_task: int | None) -> int:
    if not 1 <= n_tasks <= n_classes:
        raise ConfigError(f"n_tasks: must be between 1 and the number of classes {n_classes} (got {n_tasks})")
    if classes_per_task is None:
        if n_classes % n_tasks:
            raise ConfigError(
                f"n_tasks: {n_classes} classes do not split evenly into {n_tasks} tasks; set classes_per_task"
            )
        return n_classes // n_tasks
    if classes_per_task < 1 or n_tasks * classes_per_task > n_classes:
        raise ConfigError(
            f"classes_per_task: n_tasks * classes_per_task must be between 1 and the number of classes "
            f"{n_classes} (got {n_tasks} * {classes_per_task})"
        )
    return classes_per_task
