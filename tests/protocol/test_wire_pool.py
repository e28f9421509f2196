"""The wire pool — every client in a runtime of its own, every message through the codec as bytes — reaches the
in-process pool's metrics, server state and client states: nothing crosses between server and clients except
messages. Exact on the sequential backend; within 1e-6 on the vectorized one (one client per runtime trains on
the looped path there)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
from fedtest import BLOBS6, PROTOCOL_CASES, assert_trees_close, merged, with_overrides

from fedmosaic.data.federated import build
from fedmosaic.engine.federation import Federation
from fedmosaic.errors import ConfigError
from fedmosaic.runs.checkpoints import latest_checkpoint
from fedmosaic.runs.records import read_metrics
from fedmosaic.runs.runner import run
from fedmosaic.setup.groups import data_spec
from fedmosaic.setup.world import build_federation

IDS = [c[0]["name"] for c in PROTOCOL_CASES]


def config(algo: dict, over: dict, backend: str):
    raw = merged({**BLOBS6, "algorithm": algo, "engine": {"backend": backend, "threads": 1}}, over)
    return with_overrides(raw)


def records(fed: Federation, rounds, one_per_client: bool = True) -> list[dict]:
    """Per round its record and evaluation; over the wire with one runtime per client (each client its own device,
    as the record counts them), also that the round's bytes are those that travelled."""
    out = []
    for t in rounds:
        before = wired(fed) if one_per_client else None
        rec = fed.round(t)
        if before is not None:
            after = wired(fed)
            assert (rec["bytes_down"], rec["bytes_up"]) == (after[0] - before[0], after[1] - before[1])
        rec.update(fed.evaluate(t))
        out.append(rec)
    return out


def wired(fed: Federation) -> tuple[int, int] | None:
    """The bytes a wire pool has sent down and up for rounds' training and exchange so far."""
    traffic = getattr(fed.pool, "traffic", None)
    if traffic is None:
        return None
    return tuple(sum(traffic.get(a, [0, 0])[i] for a in ("train", "public_logits")) for i in (0, 1))


def close(a, b, tol: float, where: str = "") -> None:
    """Equal in structure; numbers equal (``tol`` 0) or within ``tol`` relative and absolute."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            close(a[k], b[k], tol, f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            close(x, y, tol, f"{where}[{i}]")
    elif isinstance(a, float) and tol:
        assert math.isclose(a, b, rel_tol=tol, abs_tol=tol), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a} != {b}"


def parity(algo: dict, over: dict, backend: str, tol: float) -> None:
    cfg = config(algo, over, backend)
    fd = build(data_spec(cfg))
    local, wire = build_federation(cfg, fd), build_federation(cfg, fd, pool="wire")
    assert len(wire.pool.hosted()) == fd.num_clients
    a, b = records(local, range(cfg.train.rounds)), records(wire, range(cfg.train.rounds))
    close([{k: v for k, v in r.items() if not k.startswith("time")} for r in a], b, tol)
    assert_trees_close(local.state_dict(), wire.state_dict(), exact=tol == 0, atol=tol, rtol=tol)


@pytest.mark.parametrize("algo, over", PROTOCOL_CASES, ids=IDS)
def test_the_wire_pool_reaches_the_in_process_numbers_exactly(algo, over):
    parity(algo, over, "sequential", 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("algo, over", PROTOCOL_CASES, ids=IDS)
def test_the_wire_pool_reaches_the_vectorized_numbers(algo, over):
    parity(algo, over, "vectorized", 1e-6)


@pytest.mark.parametrize("algo, over", [PROTOCOL_CASES[6], PROTOCOL_CASES[12]], ids=["fedpac", "fedweit"])
def test_a_checkpoint_resumes_in_the_other_pool(algo, over):
    """Written by one pool, read by the other: the next rounds are those of an uninterrupted run."""
    cfg = config(algo, over, "sequential")
    fd = build(data_spec(cfg))
    whole = records(build_federation(cfg, fd), range(cfg.train.rounds))
    for first, then in (("local", "wire"), ("wire", "local")):
        before = build_federation(cfg, fd, pool=first)
        records(before, range(2))
        buf = io.BytesIO()
        torch.save(before.state_dict(), buf)
        after = build_federation(cfg, fd, pool=then)
        after.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
        close({k: v for k, v in whole[2].items() if not k.startswith("time")}, records(after, [2])[0], 0.0)


def test_runtimes_hosting_shards_of_clients_answer_as_one_runtime_hosting_all():
    """Client ids keep their meaning on a runtime that hosts some clients (its data splits keep every client's
    range, empty for the others): shards {0, 1, 2} and {3, 4, 5} of a two-architecture run (clients alternate
    between the architectures) give the numbers of the in-process pool."""
    algo, over = PROTOCOL_CASES[8]  # AHF: two architectures, a warm-up, an exchange
    cfg = config(algo, over, "sequential")
    fd = build(data_spec(cfg))
    local, sharded = build_federation(cfg, fd), build_federation(cfg, fd)
    sharded.pool = sharded.wire_pool([[2, 0, 1], [3, 5, 4]])
    assert [sorted(h.clients.tolist()) for h in sharded.pool.hosted()] == [[0, 1, 2], [3, 4, 5]]
    assert all(len(h.groups) == 2 for h in sharded.pool.hosted())  # each shard holds both architectures
    close([{k: v for k, v in r.items() if not k.startswith("time")} for r in records(local, range(3))],
          records(sharded, range(3), one_per_client=False), 0.0)
    assert_trees_close(local.state_dict(), sharded.state_dict(), exact=True)


@pytest.mark.parametrize("algo, over", [PROTOCOL_CASES[3], PROTOCOL_CASES[8], PROTOCOL_CASES[12]],
                         ids=["ditto", "ahf", "fedweit"])
def test_a_wire_pool_holding_one_runtime_at_a_time_reaches_the_same_numbers(algo, over):
    """Runtimes exist only while their clients have messages: with room for one, every message builds its
    client's runtime from the state the previous one left in a file (personal models, a warm-up and an exchange,
    task ends with exemplar memories) — and the run is the in-process one exactly; the files go with the pool."""
    cfg = config(algo, over, "sequential")
    fd = build(data_spec(cfg))
    local, wire = build_federation(cfg, fd), build_federation(cfg, fd, pool="wire")
    wire.pool.keep, most, built = 1, [0], wire.pool.make

    def make(shard):
        most[0] = max(most[0], len(wire.pool.built) + 1)
        return built(shard)

    wire.pool.make = make
    a, b = records(local, range(cfg.train.rounds)), records(wire, range(cfg.train.rounds))
    close([{k: v for k, v in r.items() if not k.startswith("time")} for r in a], b, 0.0)
    assert_trees_close(local.state_dict(), wire.state_dict(), exact=True)
    assert most[0] == 2 and len(wire.pool.built) == 1  # (the one being built, beside the one about to leave)
    folder = Path(wire.pool._dir.name)
    assert len(list(folder.glob("shard_*.fmsg"))) == fd.num_clients  # (every client's state left once at least)
    wire.pool.close()
    assert not folder.exists()


def test_each_metric_says_where_it_is_computed():
    weit, glfc = (config(*PROTOCOL_CASES[i], "sequential") for i in (12, 13))
    assert build_federation(weit).metric_sides()["continual"] == "simulation"  # personal models on the global test set
    assert build_federation(glfc).metric_sides()["continual"] == "server"  # the global model, on the server
    assert build_federation(weit).metric_sides()["cross"] == "simulation"


def test_the_wire_pool_refuses_the_cross_matrix_in_one_line():
    cfg = config({"name": "ditto"}, {"eval": {"cross_clients": True}, "engine": {"pool": "wire"}}, "sequential")
    with pytest.raises(ConfigError, match="cross_clients: the K x K matrix needs every client's test split in one "
                                          "process; it is measured with engine.pool: local only"):
        build_federation(cfg)


@pytest.mark.parametrize("first, then", [("wire", "local"), ("local", "wire")])
def test_a_run_stopped_in_one_pool_resumes_in_the_other(first, then, tmp_path):
    """``fedmosaic run --resume --amend --set engine.pool=...``: the checkpoint does not depend on the pool that
    wrote it."""
    algo, over = PROTOCOL_CASES[12]  # FedWeIT: a store, exemplar memory and a task end
    cfg = config(algo, over, "sequential")
    fd = build(data_spec(cfg))
    run(cfg, tmp_path / "whole", progress=False, fd=fd)
    run(with_overrides(merged(cfg.model_dump(mode="json"), {"engine": {"pool": first}})), tmp_path / "cut",
        progress=False, fd=fd, stop_after=1)
    assert latest_checkpoint(tmp_path / "cut").name == "round_00001.pt"
    run(with_overrides(merged(cfg.model_dump(mode="json"), {"engine": {"pool": then}})), tmp_path / "cut",
        progress=False, fd=fd, resume=True, amend=True)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time")} for r in rs]  # noqa: E731
    assert strip(read_metrics(tmp_path / "cut")) == strip(read_metrics(tmp_path / "whole"))
    meta = json.loads((tmp_path / "cut" / "meta.json").read_text())
    assert meta["metric_sides"]["continual"] == "simulation" and meta["metric_sides"]["global"] == "server"
