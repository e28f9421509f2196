"""Continual metrics against a hand-computed 3-task example."""

import math

import numpy as np
import pytest

from fedmosaic.runs.continual import continual_summary

NAN = math.nan
A = [[0.90, NAN, NAN],
     [0.60, 0.80, NAN],
     [0.50, 0.70, 0.85]]


def test_accuracy_matrix_average_accuracy_and_backward_transfer_by_hand():
    s = continual_summary(A, seen=[0.90, 0.70, 0.68])
    assert s["acc_final"] == pytest.approx((0.50 + 0.70 + 0.85) / 3)
    assert s["bwt"] == pytest.approx(((0.50 - 0.90) + (0.70 - 0.80)) / 2)  # -0.25
    # task 0: best before the end 0.90, now 0.50; task 1: best 0.80, now 0.70
    assert s["forgetting"] == pytest.approx([0.40, 0.10]) and s["forgetting_mean"] == pytest.approx(0.25)
    assert s["avg_incremental"] == pytest.approx((0.90 + 0.70 + 0.68) / 3)


def test_forgetting_takes_the_best_earlier_accuracy_not_the_first():
    a = [[0.5, NAN, NAN], [0.9, 0.6, NAN], [0.7, 0.6, 0.8]]
    s = continual_summary(a)
    assert s["forgetting"] == pytest.approx([0.2, 0.0]) and s["bwt"] == pytest.approx((0.2 + 0.0) / 2)


def test_an_old_task_the_last_row_did_not_judge_is_out_of_bwt_and_forgetting_alike():
    a = [[0.9, NAN, NAN], [0.8, 0.7, NAN], [NAN, 0.5, 0.6]]  # task 0 unjudged after the last task
    s = continual_summary(a)
    assert s["bwt"] == pytest.approx(0.5 - 0.7) and s["forgetting_mean"] == pytest.approx(0.7 - 0.5)
    assert s["acc_final"] == pytest.approx((0.5 + 0.6) / 2)  # ACC too, not NaN


def test_one_task_and_bad_shapes():
    # no old task: BWT and forgetting are undefined, not a perfect 0
    assert continual_summary([[0.7]]) == {"acc_final": 0.7, "bwt": None, "forgetting": [], "forgetting_mean": None}
    with pytest.raises(ValueError, match="square"):
        continual_summary(np.zeros((2, 3)))
