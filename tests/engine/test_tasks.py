"""Class-incremental task streams in the engine: what a client trains on in each round."""

from __future__ import annotations

import numpy as np
import pytest

from fedmosaic.config import validate
from fedmosaic.errors import ConfigError
from fedmosaic.setup.world import build_federation


def make_cfg(**tasks):
    return validate({
        "seed": 4, "data": {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"}, "client_test": 0.2,
                            "tasks": {"n_tasks": 5, "rounds_per_task": 2, **tasks}},
        "model": {"name": "mlp", "options": {"hidden": 8}},
        "train": {"rounds": 10, "clients_per_round": 4, "batch_size": 16}})


@pytest.mark.parametrize("order", ["shared", "random"])
def test_a_clients_batches_in_a_task_come_only_from_that_tasks_classes(order):
    fed = build_federation(make_cfg(order=order))
    trainer, seen = fed.groups[0].trainer, []
    plan = trainer._plan

    def spy(data, clients, *args):
        out = plan(data, clients, *args)
        seen.append((clients, out["rows"], out["mask"]))
        return out

    trainer._plan = spy
    y = fed.split["train"].y
    for t in range(10):
        seen.clear()
        fed.round(t)
        for clients, rows, mask in seen:
            for i, k in enumerate(clients):
                task_id, classes, offsets = fed.tasks[k][t // 2]
                labels = y[rows[:, i][mask[:, i] > 0]].cpu().numpy()
                assert set(labels) <= set(classes.tolist())
                assert len(labels) == len(offsets)  # one epoch: every sample of the task once
    ids = [[task for task, *_ in st] for st in fed.tasks]
    if order == "shared":
        assert all(i == list(range(5)) for i in ids)
    else:
        assert all(sorted(i) == list(range(5)) for i in ids) and len({tuple(i) for i in ids}) > 1
    classes = [set(c.tolist()) for _, c, _ in fed.tasks[0]]
    assert set().union(*classes) == set(range(10)) and sum(map(len, classes)) == 10  # disjoint tasks


def test_a_shared_order_keeps_stage_j_task_j_and_a_client_without_it_sits_it_out():
    """Label skew: a client that holds no sample of a task has no task at its stage (it is not chosen then), so
    the federation meets the tasks in the shared order and column j of the accuracy matrix is task j's classes."""
    fed = build_federation(validate({**make_cfg().model_dump(), "data": {
        **make_cfg().data.model_dump(), "partition": {"scheme": "label_k", "k": 4}}}))
    streams = fed.tasks
    assert any(task is None for st in streams for task in st)  # (this partition leaves some tasks out)
    assert all(task is None or task[0] == j for st in streams for j, task in enumerate(st))
    task_classes = {task[0]: set(task[1].tolist()) for st in streams for task in st if task}
    for t in range(10):
        stage = t // 2
        holders = {k for k, st in enumerate(streams) if stage < len(st) and st[stage] is not None}
        assert set(fed.srv.chosen(t).tolist()) == holders
        first = fed.first_met(stage)
        assert {c for c in range(10) if first[c] == stage} == task_classes[stage]  # stage j met task j's classes
        rec = fed.round(t)
        assert rec["train_loss"] == rec["train_loss"]  # (trained: finite)
    last = fed.evaluate(9)["continual"]
    assert len(last["tasks"]) == 5 and all(v is not None for v in last["tasks"])


def test_a_shared_order_task_nobody_holds_is_a_one_line_error():
    cfg = make_cfg(tasks_per_client=1)
    with pytest.raises(ConfigError, match=r"data.tasks: no client holds a sample of task \d \(shared order\)"):
        build_federation(cfg)


def test_rounds_beyond_the_last_task_are_a_one_line_error():
    with pytest.raises(ConfigError, match=r"train.rounds: the longest client task stream \(5 tasks of 1 rounds\) ends "
                                          r"after round 5"):
        build_federation(make_cfg(rounds_per_task=1))


def test_the_calendar_is_the_servers_view_of_the_streams():
    from fedmosaic.engine.server.calendar import TaskCalendar

    streams = [[(0, np.array([0, 1])), (1, np.array([2, 3]))],  # two tasks
               [(1, np.array([2, 3])), (2, np.array([4])), (0, np.array([0, 1]))]]  # three, its own order
    cal = TaskCalendar(streams, rounds_per_task=2, num_classes=6)
    assert [cal.stage(t) for t in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [cal.task_ends(t) for t in range(4)] == [False, True, False, True]
    assert cal.first_met(0).tolist() == [0, 0, 0, 0, 1, 1] and cal.first_met(1).tolist() == [0, 0, 0, 0, 1, 2]
    assert cal.seen_classes(1).tolist() == [True] * 5 + [False]
    assert cal.live(3) is None and cal.live(4).tolist() == [1]  # client 0's stream ended after stage 1
