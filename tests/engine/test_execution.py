"""How a run executes: the ``auto`` choice (a pure function of model, device and run shape), the looped steps of the
vectorized path giving the mapped numbers, and the choice being printed and recorded."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from fedtest import BLOBS8, assert_trees_close, blobs8_partition, train, with_overrides
from torch import nn

from fedmosaic.config import validate
from fedmosaic.engine.client import execution as ex
from fedmosaic.engine.client import threads as th
from fedmosaic.engine.client.execution import ModelFacts, RunFacts, choose, step_profile
from fedmosaic.errors import ConfigError
from fedmosaic.runs.runner import run
from fedmosaic.setup.world import build_federation

DENSE = ModelFacts("LogisticRegression", 7_850, conv=False, buffers=False)
CONV = ModelFacts("_ConvNet", 2_156_490, conv=True, buffers=False)
SHORT = RunFacts(3, (0.0, 20.0, 5.0, 4.0), batch=10)
#: a cohort of ten in lockstep for 2,000 steps a round: compiling saves far more than its warm-up
LONG = RunFacts(1_000, (0.0,) * 10 + (2_000.0,), batch=10)


def make_cfg(**over):
    return with_overrides(copy.deepcopy(BLOBS8), **{'train__clients_per_round': 6, **over})


@pytest.fixture(scope="module")
def fd(blob_data):
    return blobs8_partition(blob_data)


# ---- the rule ----------------------------------------------------------------------------------------------------
def test_defaults_are_auto_and_explicit_settings_are_kept():
    e = validate({}).engine
    assert (e.backend, e.compile) == ("auto", "auto")
    vec = choose("vectorized", False, 8, CONV, "cpu", LONG)
    assert (vec.backend, vec.compile, vec.loop_below, vec.auto) == ("vectorized", False, 0, ())  # pure vmap
    assert vec.describe() == "vectorized (as configured)"
    seq = choose("sequential", "auto", 8, DENSE, "cpu", LONG, compiler=True)
    assert (seq.backend, seq.compile) == ("sequential", False)  # compiling needs the mapped step
    forced = choose("vectorized", True, 16, DENSE, "cpu", SHORT)
    assert (forced.compile, forced.fuse_steps) == (True, 16)
    # an explicit compile that cannot be kept (the per-client loop: configured, or a BatchNorm model's) is said
    bn = ModelFacts("Wrapped", 100, conv=True, buffers=True)
    for backend, model, why in (("sequential", DENSE, "engine.backend: sequential"), ("auto", bn, "buffers")):
        with pytest.warns(UserWarning, match=f"engine.compile: true, but no compile: .*{why}"):
            assert not choose(backend, True, 8, model, "cpu", LONG, compiler=True).compile


def test_auto_on_the_cpu_loops_convolutions_and_vectorizes_dense_models_with_a_looped_tail():
    conv = choose("auto", "auto", 8, CONV, "cpu", LONG, compiler=True)
    assert (conv.backend, conv.compile) == ("sequential", False)
    assert "vmap over convolutions is slower" in conv.why and conv.auto == ("backend",)
    assert conv.channels_last and conv.label == "sequential, channels-last inputs"
    assert not choose("sequential", "auto", 8, CONV, "cpu", LONG).channels_last  # explicit: the reference path
    dense = choose("auto", "auto", 8, DENSE, "cpu", SHORT)
    assert (dense.backend, dense.compile) == ("vectorized", False)
    assert dense.loop_below == ex.loop_below_for("cpu") > 2
    assert dense.label == f"vectorized, steps of < {dense.loop_below} active clients looped, 1 thread while training"
    # on a GPU convolutions stay mapped, and only single-client steps are looped
    gpu = choose("auto", "auto", 8, CONV, "cuda", SHORT)
    assert (gpu.backend, gpu.loop_below) == ("vectorized", 2)


def test_auto_compiles_only_runs_long_enough_to_repay_the_warm_up():
    short = choose("auto", "auto", 8, DENSE, "cpu", SHORT, compiler=True)
    assert not short.compile and "no compile: it would save ~0 s" in short.why
    assert ex.compile_saving_s(LONG, "cpu", ex.loop_below_for("cpu")) > \
        ex.COMPILE_MARGIN * ex.COMPILE_WARMUP_S["cpu"]["cold"]
    long = choose("auto", "auto", 8, DENSE, "cpu", LONG, compiler=True)
    assert (long.backend, long.compile, long.fuse_steps) == ("vectorized", True, 8)
    assert long.label.startswith("vectorized+compile (fused x8)")
    assert not choose("auto", "auto", 8, DENSE, "cpu", LONG, compiler=False).compile  # no C++ compiler here
    # a program of other phases compiles too, each step alone (no fused blocks); K + 1 updates a step save K + 1 times
    not_plain = RunFacts(LONG.rounds, LONG.active, plain=False, updates=3.0)
    other = choose("auto", "auto", 8, DENSE, "cpu", not_plain, compiler=True)
    assert (other.compile, other.fuse_steps) == (True, 1) and other.label == "vectorized+compile"
    assert ex.compile_saving_s(not_plain, "cpu", 7) == pytest.approx(3 * ex.compile_saving_s(LONG, "cpu", 7))
    assert not choose("auto", "auto", 8, CONV, "cpu", LONG, compiler=True).compile  # sequential: nothing to compile
    # asking for compile with the backend left to auto takes the mapped path
    assert choose("auto", True, 8, CONV, "cpu", SHORT).backend == "vectorized"


def test_a_setting_compiled_here_before_is_compiled_for_a_shorter_run():
    """With its graphs in the compile cache (``warm``) the warm-up is the short one: a run whose saving lies
    between the warm and the cold warm-up compiles only when warm."""
    lb = ex.loop_below_for("cpu")
    cost = [ex.COMPILE_MARGIN * ex.COMPILE_WARMUP_S["cpu"][state] for state in ("warm", "cold")]
    middle = RunFacts(LONG.rounds, (0.0,) * 10 + (2_000.0 * (cost[0] + cost[1]) / 2
                                                   / ex.compile_saving_s(LONG, "cpu", lb),), batch=10)
    assert cost[0] < ex.compile_saving_s(middle, "cpu", lb) < cost[1]
    cold = choose("auto", "auto", 8, DENSE, "cpu", middle, compiler=True)
    warm = choose("auto", "auto", 8, DENSE, "cpu", middle, compiler=True, warm=True)
    assert not cold.compile and "the cold warm-up costs ~120 s" in cold.why
    assert warm.compile and "s of warm warm-up" in warm.why
    assert not choose("auto", "auto", 8, DENSE, "cpu", SHORT, compiler=True, warm=True).compile


def test_tiny_steps_train_on_one_cpu_thread_unless_threads_are_configured():
    assert choose("auto", "auto", 8, DENSE, "cpu", SHORT).threads == 1
    assert choose("auto", "auto", 8, DENSE, "cpu", SHORT, threads=2).threads is None  # engine.threads is kept
    assert choose("vectorized", False, 8, DENSE, "cpu", SHORT).threads is None  # explicit: as configured
    assert choose("auto", "auto", 8, DENSE, "cuda", SHORT).threads is None
    assert choose("auto", "auto", 8, CONV, "cpu", SHORT).threads is None  # convolutions use every thread
    big = ModelFacts("MLP", ex.TINY_STEP // 10 + 1, conv=False, buffers=False)
    assert choose("auto", "auto", 8, big, "cpu", SHORT).threads is None


@pytest.mark.slow
def test_the_trainer_restores_the_processs_threads(fd, torch_threads):
    fed = train(make_cfg(engine={"threads": 2}), fd)
    assert fed.groups[0].trainer.threads is None and torch.get_num_threads() == 2
    fed = train(make_cfg(), fd)
    assert fed.groups[0].trainer.threads == 1 and torch.get_num_threads() == fed.threads.count


# ---- CPU threads: never more than the cores free for the run -----------------------------------------------------
@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_thread_count_takes_the_runs_share_of_the_cores_less_those_kept_busy():
    assert th.thread_count(2) == 2
    assert th.thread_count(2, busy=1.0) == 1  # beside one busy core: one thread, not two waiting for one core
    assert th.thread_count(2, busy=0.4) == 2  # a core less than half busy counts free
    assert th.thread_count(2, busy=3.0) == 1  # at least one
    assert th.thread_count(16, runs=4) == 4 and th.thread_count(16, runs=4, busy=14.0) == 2
    assert th.thread_count(2, runs=3) == 1


def test_the_default_threads_follow_the_free_cores_and_what_the_user_says(monkeypatch):
    monkeypatch.setattr(th, "usable_cores", lambda: 8)
    monkeypatch.setattr(th, "busy_cores", lambda: 3.0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(th.PARALLEL_RUNS, raising=False)
    assert th.cpu_threads(None) == th.Threads(5, "8 usable cores, 3.0 kept busy by other processes")
    monkeypatch.setenv(th.PARALLEL_RUNS, "4")
    assert th.cpu_threads(None).count == 2
    assert th.cpu_threads(6) == th.Threads(6, "engine.threads")  # set: kept, whatever runs beside
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert th.cpu_threads(None) == th.Threads(3, "OMP_NUM_THREADS")
    with pytest.warns(UserWarning, match="OMP_NUM_THREADS=3, where the run started with 1 thread: "):
        assert th.cpu_threads(None, recorded=1).count == 3  # (the user's word, said to change the last bits)
    for bad in ("0", "-1", "abc", "100000"):  # OpenMP ignores the first three with a line of its own; the last
        monkeypatch.setenv("OMP_NUM_THREADS", bad)  # crashed the process without a word
        with pytest.raises(ConfigError, match=rf"^OMP_NUM_THREADS: a thread count in \[1, 1024\] \(got '{bad}'\)"):
            th.cpu_threads(None)
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv(th.PARALLEL_RUNS, "two")
    with pytest.raises(ConfigError, match=f"^{th.PARALLEL_RUNS}: .*positive integer.*'two'"):
        th.cpu_threads(None)


def test_usable_cores_honour_a_cgroup_quota(monkeypatch, tmp_path):
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "v2").write_text("150000 100000\n")  # 1.5 cores: one thread (two would be throttled)
    (tmp_path / "none").write_text("max 100000\n")
    (tmp_path / "quota").write_text("-1\n")
    (tmp_path / "period").write_text("100000\n")
    monkeypatch.setattr(th, "CGROUP_QUOTA", ((tmp_path / "v2",),))
    assert th.usable_cores() == 1
    monkeypatch.setattr(th, "CGROUP_QUOTA", ((tmp_path / "none",), (tmp_path / "quota", tmp_path / "period"),
                                             (tmp_path / "absent",)))
    assert th.usable_cores() == affinity
    (tmp_path / "quota").write_text("100000\n")
    assert th.usable_cores() == 1


def test_a_busy_process_beside_the_run_is_seen():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # its interpreter started
        assert th.busy_cores.__wrapped__(0.5) >= 0.5
    finally:
        busy.kill()
        busy.wait()


def test_a_run_takes_the_free_cores_prints_and_records_them(fd, tmp_path, capsys, monkeypatch, torch_threads):
    monkeypatch.setattr(th, "usable_cores", lambda: 2)
    monkeypatch.setattr(th, "busy_cores", lambda: 1.0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(th.PARALLEL_RUNS, raising=False)
    torch.set_num_threads(2)
    run(make_cfg(engine={"backend": "sequential"}), tmp_path / "r", progress=False, fd=fd)
    assert torch.get_num_threads() == 1  # evaluation too: not only training's tiny steps
    assert capsys.readouterr().out.splitlines()[0] == ("fedmosaic: execution: sequential (as configured); 1 CPU thread "
                                                        "(2 usable cores, 1.0 kept busy by other processes)")
    [rec] = json.loads((tmp_path / "r" / "meta.json").read_text())["execution"]
    assert (rec["cpu_threads"], rec["cpu_threads_why"]) == (1, "2 usable cores, 1.0 kept busy by other processes")


def test_a_resumed_run_keeps_the_threads_it_started_with(fd, tmp_path, capsys, monkeypatch, torch_threads):
    """The thread count changes a sum's last bits: a run resumed on a quieter machine must not switch."""
    monkeypatch.setattr(th, "usable_cores", lambda: 2)
    monkeypatch.setattr(th, "busy_cores", lambda: 1.0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(th.PARALLEL_RUNS, raising=False)
    cfg = make_cfg(engine={"backend": "sequential"}, train__rounds=3)
    run(cfg, tmp_path / "r", progress=False, fd=fd, stop_after=1)
    monkeypatch.setattr(th, "busy_cores", lambda: 0.0)  # the other process is gone: a new run would take 2
    capsys.readouterr()
    run(cfg, tmp_path / "r", resume=True, progress=False, fd=fd)
    assert torch.get_num_threads() == 1
    assert capsys.readouterr().out.splitlines()[0].endswith("; 1 CPU thread (as when the run started)")
    run(cfg, tmp_path / "n", progress=False, fd=fd)
    assert torch.get_num_threads() == 2


def test_models_with_buffers_always_take_the_per_client_loop():
    bn = ModelFacts("Wrapped", 100, conv=True, buffers=True)
    for backend in ("auto", "vectorized"):
        e = choose(backend, "auto", 8, bn, "cuda", LONG, compiler=True)
        assert (e.backend, e.compile) == ("sequential", False) and "BatchNorm" in e.why


def test_step_profile_counts_lockstep_steps_by_active_clients():
    steps = np.array([10, 3, 7, 1])
    # cohort {0,1,2}: 3 steps with 3 active, 4 with 2 (7-3), 3 with 1 (10-7); cohort {3}: 1 step with 1
    prof = step_profile(steps, [np.array([0, 1, 2]), np.array([3])], chunk=128)
    assert prof == pytest.approx((0.0, (3 + 1) / 2, 4 / 2, 3 / 2))
    run_ = RunFacts(5, prof)
    assert run_.lockstep_steps == pytest.approx(11 / 2) and run_.client_steps == pytest.approx(21 / 2)
    # chunks of two: {0,1} then {2}
    assert step_profile(steps, [np.array([0, 1, 2])], chunk=2) == pytest.approx((0.0, 7 + 7, 3))


def test_model_facts():
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 2))
    facts = ModelFacts.of(conv)
    assert facts.conv and not facts.buffers and facts.params == sum(p.numel() for p in conv.parameters())
    assert ModelFacts.of(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))).buffers


def test_config_errors_name_the_choices():
    for raw, needle in (({"backend": "gpu"}, "engine.backend: must be 'vectorized' or 'sequential', or 'auto'"),
                        ({"compile": "yes"}, "engine.compile: must be true, false or 'auto' (got 'yes')")):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            validate({"engine": raw})


# ---- the looped steps give the mapped numbers ----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("algo", [{"name": "fedavg"}, {"name": "fedprox", "mu": 0.5}, {"name": "fedcurv"},
                                  {"name": "pfedme", "K": 2}, {"name": "perfedavg"}, {"name": "ditto", "lam": 0.3},
                                  {"name": "fedproto", "lam": 1.0}])
@pytest.mark.parametrize("optimizer", [{"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}, {"name": "adam", "lr": 0.01}])
def test_mixed_looped_and_mapped_steps_equal_pure_vmap(fd, algo, optimizer):
    """A ragged cohort run with the tail looped (fewer than 3 active clients) equals the same run all mapped."""
    ref = train(make_cfg(algorithm=algo, train__optimizer=optimizer, engine={"backend": "vectorized"}), fd)
    fed = build_federation(make_cfg(algorithm=algo, train__optimizer=optimizer, engine={"backend": "vectorized"}), fd)
    fed.groups[0].trainer.loop_below = 3
    for t in range(fed.cfg.train.rounds):
        fed.round(t)
    assert_trees_close(ref.server, fed.server)
    if ref.groups[0].store:
        assert_trees_close(ref.groups[0].store, fed.groups[0].store)


@pytest.mark.cpu
def test_auto_run_equals_vectorized_and_sequential(fd):
    auto = train(make_cfg(), fd)
    assert auto.groups[0].execution.auto == ("backend", "compile")
    assert auto.groups[0].trainer.loop_below == ex.loop_below_for("cpu")
    for backend in ("vectorized", "sequential"):
        other = train(make_cfg(engine={"backend": backend}), fd)
        assert_trees_close(auto.server, other.server)


def tiny_cnn(batchnorm: bool = False) -> str:
    """The name of a registered convolutional model for the blobs' C x 6 x 6 images (with BatchNorm after its
    convolution, or not)."""
    from fedmosaic.models import MODELS, Wrapped, register_model

    name = "user_tiny_bn_cnn" if batchnorm else "user_tiny_cnn"

    def build(input_shape, num_classes):
        norm = [nn.BatchNorm2d(3)] if batchnorm else []
        body = nn.Sequential(nn.Conv2d(input_shape[0], 3, 3), *norm, nn.ReLU(), nn.Flatten(),
                             nn.Linear(3 * 4 * 4, 8), nn.Tanh())
        return Wrapped(body, nn.Linear(8, num_classes))

    if name not in MODELS:
        register_model(name, build)
    return name


def rgb_blobs(val: float):
    """The blobs on 3-channel images, where the channels-last and NCHW orders are different memory (with one
    channel they are the same), over 8 clients with ``val`` of each client's samples for validation."""
    from conftest import blobs

    return blobs8_partition(blobs(shape=(3, 6, 6)), val=val)


@pytest.mark.cpu
def test_a_convolutional_model_runs_sequential_on_the_cpu_with_the_mapped_numbers(fd):
    cfg = make_cfg(model={"name": tiny_cnn()}, engine={"device": "cpu"})
    auto = train(cfg, fd)
    assert auto.groups[0].execution.backend == "sequential" and not auto.groups[0].trainer.vectorize
    assert auto.groups[0].trainer.channels_last
    vec = train(make_cfg(model={"name": "user_tiny_cnn"}, engine={"backend": "vectorized"}), fd)
    assert_trees_close(auto.server, vec.server)
    assert auto.evaluate()["global"]["acc"] == pytest.approx(vec.evaluate()["global"]["acc"], abs=1e-6)


@pytest.mark.cpu
def test_a_channels_last_model_is_judged_in_its_memory_order_in_small_batches_with_the_same_numbers():
    """Models that train on the CPU's channels-last path are judged channels-last, ``NHWC_BATCH`` samples at a
    time (activations that stay in cache: the evaluation's speed); every metric — the global test set, the
    clients' test and validation splits, their own models, the cross matrix — is the NCHW evaluation's."""
    from fedmosaic.engine.evaluate import NHWC_BATCH

    rgb = rgb_blobs(0.2)
    cfg = make_cfg(model={"name": tiny_cnn()}, algorithm={"name": "ditto"}, engine={"device": "cpu"},
                   data__client_val=0.2, eval={"cross_clients": True, "global_test": True})
    fed = train(cfg, rgb, rounds=1)
    g = fed.groups[0]
    assert g.trainer.channels_last
    seen, judged = [], {}
    g.module.register_forward_pre_hook(lambda m, args: seen.append(
        (len(args[0]), args[0].is_contiguous(memory_format=torch.channels_last))))
    for last in (True, False):
        g.trainer.channels_last, seen[:] = last, []
        judged[last] = (fed.evaluate(1), list(seen))
    (nhwc, inputs), (nchw, inputs_nchw) = judged[True], judged[False]
    assert {"global", "global_clients", "global_val", "personal", "personal_val", "cross"} <= set(nhwc)
    assert nhwc == nchw
    assert inputs and all(n <= NHWC_BATCH and last for n, last in inputs)
    # (so the test tells the two apart: NCHW inputs, some batches larger than NHWC_BATCH)
    assert max(n for n, _ in inputs_nchw) > NHWC_BATCH and not any(last for _, last in inputs_nchw)


@pytest.mark.cpu
@pytest.mark.parametrize("algo", ["fedcurv", "apfl_pd", "fedpac", "ifca"])
def test_probes_of_a_batchnorm_cnn_in_channels_last_order_equal_the_nchw_ones(algo):
    """The CPU's default for a convolutional model (sequential, channels-last inputs) against the reference path
    (NCHW; a model with BatchNorm takes the sequential path whatever the backend asked, vmap cannot move running
    statistics per client), on 3-channel images (where the two memory orders differ) in a ragged cohort: gradient
    probes (FedCurv's Fisher, APFL-PD's importance) and sums returned as dicts (FedPAC's, IFCA's) read the same
    samples whichever order their inputs are laid out in."""
    from fedmosaic.protocol.tree import leaves

    rgb = rgb_blobs(0.0)
    cfg = dict(model={"name": tiny_cnn(batchnorm=True)}, algorithm={"name": algo}, engine={"device": "cpu"})
    auto = train(make_cfg(**cfg), rgb, rounds=2)
    assert auto.groups[0].trainer.channels_last and not auto.groups[0].trainer.vectorize
    sizes = auto.split["train"].sizes
    assert sizes.min() * 2 <= sizes.max(), "the cohort is not ragged: the test would prove nothing"
    ref = train(make_cfg(**{**cfg, "engine": {"device": "cpu", "backend": "sequential"}}), rgb, rounds=2)
    assert not ref.groups[0].trainer.channels_last
    assert_trees_close(auto.server, ref.server)
    if leaves(auto.groups[0].store):
        assert_trees_close(auto.groups[0].store, ref.groups[0].store)


def test_the_finished_client_stays_put_on_the_looped_path(fd):
    """Packing and looping together: a small client trained in a cohort equals it trained alone."""
    fed = build_federation(make_cfg(algorithm={"name": "local"}, train__clients_per_round=8), fd)
    g = fed.groups[0]
    g.trainer.loop_below = 10**6  # every step looped
    sizes = fed.split["train"].sizes
    small, big = int(np.argmin(sizes)), int(np.argmax(sizes))
    payload = fed.algo.broadcast(fed.server, 0)
    kw = {"epochs": 2, "batch": 8, "lr": 0.05, "seed": 3, "round_idx": 0}
    both = np.array(sorted([small, big]))
    _, together, _, _, _ = g.trainer.train(fed.split["train"], both, payload, {k: {n: t[both] for n, t in v.items()}
                                                                           for k, v in g.store.items()}, {}, **kw)
    alone = np.array([small])
    _, solo, _, _, _ = g.trainer.train(fed.split["train"], alone, payload, {k: {n: t[alone] for n, t in v.items()}
                                                                        for k, v in g.store.items()}, {}, **kw)
    row = int(np.flatnonzero(both == small)[0])
    for name, t in together["model"].items():
        torch.testing.assert_close(t[row], solo["model"][name][0], atol=1e-6, rtol=1e-5)


# ---- printed and recorded ------------------------------------------------------------------------------------------
@pytest.mark.cpu
def test_the_run_prints_and_records_its_execution(fd, tmp_path, capsys):
    run(make_cfg(), tmp_path / "r", progress=False, fd=fd)
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("fedmosaic: execution: vectorized, steps of < ") and "(auto: cpu; dense model of " in line
    meta = json.loads((tmp_path / "r" / "meta.json").read_text())
    [rec] = meta["execution"]
    assert rec["model"] == "MLP" and rec["backend"] == "vectorized" and rec["compile"] is False
    assert rec["chosen"] == ["backend", "compile"] and rec["label"] in line
    run(make_cfg(engine={"backend": "sequential", "threads": 1}), tmp_path / "s", progress=False, fd=fd)
    assert capsys.readouterr().out.splitlines()[0] == ("fedmosaic: execution: sequential (as configured); "
                                                        "1 CPU thread (engine.threads)")
