"""engine.pool: ray — shards of clients on Ray actors reach the numbers of one process: exactly on the sequential
backend, within 1e-6 on the vectorized one (an actor trains its shard's cohort members together: other vmap
batches). One algorithm per family, an actor killed mid-run, checkpoints moving between one process and actors,
and the errors a user meets in one line."""

from __future__ import annotations

import json
import os
import signal
import time
import warnings

import pytest
from deploy.cases import same_metrics
from fedtest import assert_trees_close
from scale.raytools import cfg_of

from fedmosaic.data.federated import build
from fedmosaic.engine.federation import Federation
from fedmosaic.errors import FedMosaicError
from fedmosaic.runs.records import read_metrics
from fedmosaic.runs.runner import run
from fedmosaic.setup.groups import data_spec
from fedmosaic.setup.world import build_federation, ray_pool

FAMILIES = ["fedavg", "scaffold", "ditto", "apfl_pd", "ahf", "protofcl"]
pytestmark = pytest.mark.usefixtures("bounded")


def records(fed: Federation) -> list[dict]:
    out = []
    for t in range(fed.cfg.train.rounds):
        rec = fed.round(t)
        rec.update(fed.evaluate(t))
        out.append(rec)
    return out


#: FedAvg under attack and defence: flipped labels in the actors' data, local DP noise added by their client
#: runtimes, a server optimizer on the driver
ROBUST = {"attack": {"kind": "label_flip", "fraction": 0.4}, "privacy": {"mode": "local", "noise": 0.5, "clip": 1.0},
          "aggregation": {"optimizer": "adam"}, "participation": {"dropout": 0.3, "stragglers": 0.5, "held_out": 0.2}}


# every family exactly on the sequential path (and FedAvg attacked and defended, with dropouts, stragglers and a
# held-out client); the vectorized path (the same
# runtime code on actors) for two families, one global and one continual with personal state (each pair costs ~7 s
# of CI)
@pytest.mark.parametrize("family, backend, tol", [*((f, "sequential", 0.0) for f in [*FAMILIES, "robust"]),
                                                  ("fedavg", "vectorized", 1e-6), ("protofcl", "vectorized", 1e-6)])
def test_each_family_on_ray_actors_reaches_the_numbers_of_one_process(ray_runtime, family, backend, tol):
    cfg = cfg_of("fedavg", backend, **ROBUST) if family == "robust" else cfg_of(family, backend)
    fd = build(data_spec(cfg))
    local = build_federation(cfg, fd)
    sharded = build_federation(cfg, fd, pool="ray")
    try:
        hosted = [len(h.clients) for h in sharded.pool.hosted()]
        assert hosted == [3, 2], hosted
        a, b = records(local), records(sharded)
        assert not same_metrics(a, b, tol), same_metrics(a, b, tol)[:5]
        if tol == 0:
            assert [{k: v for k, v in r.items() if not k.startswith("time")} for r in a] == b
        assert_trees_close(local.state_dict(), sharded.state_dict(), exact=tol == 0, atol=tol, rtol=tol)
        # the driver keeps no client's state: the actors do
        assert all(not g.store for g in sharded.groups)
    finally:
        sharded.pool.close()


def test_an_actor_killed_mid_run_is_replaced_and_the_run_ends_as_an_uninterrupted_one(ray_runtime, tmp_path):
    cfg = cfg_of("ditto", checkpoint_every=2, train={"rounds": 5})
    run(cfg, tmp_path / "local", progress=False)
    killed, pools = [], []

    def killing(fed):
        pool = ray_pool(fed.cfg, fed)
        pools.append(pool)
        train = pool.train

        def train_after_a_kill(header, broadcast, assignment):
            if header["round"] == 3 and not killed:  # after the checkpoint of round 1, two rounds since
                killed.append(pool.where[1]["pid"])
                os.kill(killed[0], signal.SIGKILL)
            return train(header, broadcast, assignment)

        pool.train = train_after_a_kill
        return pool

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(cfg, tmp_path / "ray", progress=False, pool=killing)
    said = [str(w.message) for w in caught if "replaying from the last checkpoint" in str(w.message)]
    assert len(said) == 1 and "a Ray actor was lost while train" in said[0], said
    assert len(pools) == 2 and killed[0] not in [w["pid"] for w in pools[1].where]
    a, b = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "ray")
    assert [r["round"] for r in b] == list(range(5))
    assert not same_metrics(a, b, 0.0), same_metrics(a, b, 0.0)[:5]


def test_a_checkpoint_moves_from_one_process_to_actors_and_back(ray_runtime, tmp_path):
    cfg = cfg_of("apfl_pd", checkpoint_every=1, train={"rounds": 4})
    run(cfg, tmp_path / "whole", progress=False)
    out = tmp_path / "moved"
    run(cfg, out, progress=False, stop_after=0)  # round 0 in this process
    run(cfg, out, resume=True, progress=False, stop_after=2, pool="ray")  # rounds 1-2 on 2 actors
    run(cfg, out, resume=True, progress=False)  # round 3 in this process again
    a, b = read_metrics(tmp_path / "whole"), read_metrics(out)
    assert not same_metrics(a, b, 0.0), same_metrics(a, b, 0.0)[:5]


def test_a_checkpoint_resumes_on_another_number_of_actors(ray_runtime, tmp_path):
    two = cfg_of("protofcl", checkpoint_every=1, train={"rounds": 3})
    three = cfg_of("protofcl", checkpoint_every=1, train={"rounds": 3}, ray={"actors": 3, "cpus_per_actor": 0.5})
    run(two, tmp_path / "whole", progress=False)
    out = tmp_path / "moved"
    run(two, out, progress=False, stop_after=0, pool="ray")
    run(three, out, resume=True, amend=True, progress=False, pool="ray")
    meta = json.loads((out / "meta.json").read_text())
    assert [a["clients"] for a in meta["ray"]["actors"]] == [3, 2]
    assert not same_metrics(read_metrics(tmp_path / "whole"), read_metrics(out), 0.0)


def test_too_few_cpus_for_the_actors_is_one_line(ray_runtime):
    cfg = cfg_of("fedavg", ray={"actors": 3, "cpus_per_actor": 1.0, "start_timeout_s": 2.0})
    with pytest.raises(FedMosaicError, match=r"cannot place 3 actors of 1 CPU within 2 s .* it has 2 CPU") as e:
        build_federation(cfg, pool="ray")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("ray_over, engine, says", [
    ({"actors": 3, "cpus_per_actor": 1.0}, {}, r"3 Ray actors of 1 CPU: it has 2 CPU"),
    ({"cpus_per_actor": 1000.0}, {}, r"2 Ray actors of 1000 CPU: it has 2 CPU"),
    ({"gpus_per_actor": 1.0}, {}, r"2 Ray actors of 0.5 CPU, 1 GPU"),
    ({}, {"memory_mb": 10**8}, r"2 Ray actors of 0.5 CPU, 100,000,000 MiB memory: it has 2 CPU, [\d,]+ MiB"),
])
def test_an_impossible_placement_on_this_machines_runtime_is_refused_at_once(ray_runtime, monkeypatch, ray_over,
                                                                             engine, says):
    """A runtime of this machine's (one fedmosaic started, engine.ray.address: none) cannot grow: a placement it
    cannot hold is refused before any reservation, not after start_timeout_s."""
    from fedmosaic.engine.pools import ray as raypool

    monkeypatch.setattr(raypool, "OWN_RUNTIME", [ray_runtime.get_runtime_context().gcs_address])
    cfg = cfg_of("fedavg", ray=ray_over, engine=engine)
    t0 = time.monotonic()
    with pytest.raises(FedMosaicError, match=r"this machine cannot place " + says) as e:
        build_federation(cfg, pool="ray")
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 10
    assert not ray_runtime.util.placement_group_table() or all(
        g["state"] == "REMOVED" for g in ray_runtime.util.placement_group_table().values())


def test_a_temporary_folder_too_long_for_rays_sockets_is_one_line_before_ray_starts(monkeypatch, tmp_path):
    from fedmosaic.engine.pools.raylib import check_socket_path

    monkeypatch.setenv("RAY_TMPDIR", "/tmp")
    check_socket_path()  # /tmp: fine
    deep = tmp_path / ("d" * 60)
    monkeypatch.setenv("RAY_TMPDIR", str(deep))
    with pytest.raises(FedMosaicError, match=r"the temporary folder .* is too long for Ray's sockets \(\d+ bytes; "
                                             r"at most \d+\): set RAY_TMPDIR to a shorter folder"):
        check_socket_path()


def test_a_shard_over_the_memory_budget_is_one_line_from_the_actor(ray_runtime):
    # one client's training of a 45k-parameter model fits in 2 MiB (the driver's check passes), 3 personal models
    # and the training of 4 at once do not: the actor refuses its shard
    cfg = cfg_of("ditto", engine={"memory_mb": 2}, model={"options": {"hidden": 600}})
    with pytest.raises(FedMosaicError, match=r"a Ray actor failed starting its clients: .*needs about .* more than "
                                             r"the 2.0 MiB of memory on cpu") as e:
        build_federation(cfg, pool="ray")
    assert "\n" not in str(e.value)


def test_a_comparison_on_ray_equals_one_in_process_and_leaves_no_actor_or_reservation(ray_runtime, tmp_path):
    from fedmosaic import api

    cfg = cfg_of("fedavg")
    local = api.compare(cfg, ["fedavg", "fedprox:mu=0.1"], out=tmp_path / "local", progress=False)
    ray_cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"pool": "ray"})})
    remote = api.compare(ray_cfg, ["fedavg", "fedprox:mu=0.1"], out=tmp_path / "ray", progress=False)
    for a, b in zip(local, remote, strict=True):
        assert not same_metrics(read_metrics(a.dir), read_metrics(b.dir), 0.0)
    # every variant's actors stopped and its placement group removed (Ray frees them asynchronously)
    for _ in range(50):
        if ray_runtime.available_resources().get("CPU") == 2.0:
            break
        time.sleep(0.1)
    assert ray_runtime.available_resources().get("CPU") == 2.0, ray_runtime.available_resources()


def test_tensors_travel_as_numpy_and_arrive_as_copies_of_their_own(ray_runtime):
    import torch

    from fedmosaic.engine.pools.raylib import register_tensors

    register_tensors(ray_runtime)
    sent = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(), "b": torch.tensor([1.5, -2.0]).bfloat16(),
            "n": torch.tensor(3), "mask": torch.tensor([True, False])}
    ref = ray_runtime.put(sent)
    got = ray_runtime.get(ref)
    for k, v in sent.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    got["w"].add_(100)  # writable, and a copy: the object in the store is unchanged
    assert torch.equal(ray_runtime.get(ref)["w"], sent["w"])


def test_a_model_registered_by_the_users_script_travels_to_the_actors(ray_runtime):
    """A model class the actors cannot import (defined here, in a function) goes to them by value."""
    import math

    from torch import nn

    from fedmosaic.models import register_model

    class Tiny(nn.Module):
        def __init__(self, input_shape, num_classes, hidden=16):
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.Tanh())
            self.fc = nn.Linear(hidden, num_classes)

        def forward(self, x):
            return self.fc(self.body(x))

    register_model("tiny_of_a_script", Tiny)
    cfg = cfg_of("ditto", model={"name": "tiny_of_a_script"})
    fd = build(data_spec(cfg))
    sharded = build_federation(cfg, fd, pool="ray")
    try:
        assert not same_metrics(records(build_federation(cfg, fd)), records(sharded), 0.0)
    finally:
        sharded.pool.close()
