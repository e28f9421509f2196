"""The compile cache (``engine/client/compiled.py``): torch's compiled graphs kept in fedmosaic's cache folder between
processes, a damaged entry removed before torch reads it (one warning), a changed setting never served another's
graphs, and a run from a warm cache equal to a cold one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from fedmosaic.engine.client.compiled import CompileCache


def filled(tmp_path, n=4) -> CompileCache:
    cache = CompileCache(tmp_path / "compile")
    for i in range(n):
        (cache.root / f"d{i}").mkdir(parents=True)
        (cache.root / f"d{i}" / "entry").write_bytes(bytes([i]) * 100)
    return cache


def test_damaged_entries_are_removed_with_one_warning_and_the_rest_kept(tmp_path):
    cache = filled(tmp_path)
    cache.record("setting-a")
    (cache.root / "d0" / "entry").write_bytes(b"\x00" * 50)  # cut short
    (cache.root / "d1" / "entry").write_bytes(b"\x07" * 100)  # same size, other bytes
    (cache.root / "new").write_bytes(b"written by a run still going")  # not in the manifest: torch's to judge
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sorted(cache.remove_damaged()) == ["d0/entry", "d1/entry"]
    assert [str(w.message) for w in caught] == [f"engine.compile: 2 damaged entries of the compile cache "
                                                f"{cache.root} removed; what they held is compiled again"]
    assert not (cache.root / "d0" / "entry").exists() and (cache.root / "d2" / "entry").read_bytes() == b"\x02" * 100
    assert (cache.root / "new").exists() and cache.warm("setting-a") and not cache.warm("setting-b")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.remove_damaged() == []  # the manifest now describes what is there


def test_a_manifest_naming_files_outside_its_folder_touches_nothing(tmp_path):
    cache = filled(tmp_path, 1)
    outside = tmp_path / "keep.txt"
    outside.write_text("a user's file")
    (cache.root / "link").symlink_to(outside)
    cache.manifest.write_text(json.dumps({"files": {"../keep.txt": [1, "0" * 64], str(outside): [1, "0" * 64],
                                                    "link": [1, "0" * 64], "d0/entry": [1, "0" * 64]}}))
    with pytest.warns(UserWarning, match="1 damaged entry"):
        assert cache.remove_damaged() == ["d0/entry"]
    assert outside.read_text() == "a user's file" and (cache.root / "link").is_symlink()


def test_a_damaged_manifest_vouches_for_nothing(tmp_path):
    cache = filled(tmp_path, 2)
    cache.record("setting-a")
    cache.manifest.write_text('{"files": {"d0/entry": [100,')
    with pytest.warns(UserWarning, match="2 damaged entries"):
        cache.remove_damaged()
    assert not any(p.is_file() for p in (cache.root / "d0", cache.root / "d1")) and not cache.warm("setting-a")


def test_torchs_variable_wins_over_fedmosaics_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDMOSAIC_CACHE", str(tmp_path / "fm"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    import torch

    assert CompileCache.default().root == tmp_path / "fm" / "compile" / f"torch-{torch.__version__}"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert CompileCache.default().root == tmp_path / "mine"


#: one compiled round of a tiny model, in a process of its own: its loss, the compile cache's hits and misses, the
#: warnings said, and whether its setting was warm before
CHILD = r"""
import json, sys, warnings
from fedmosaic.config import validate
from fedmosaic.setup.world import build_federation
from torch._dynamo.utils import counters
hidden = int(sys.argv[1])
cfg = validate({"seed": 1, "data": {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"}},
                "model": {"name": "mlp", "options": {"hidden": hidden}},
                "train": {"rounds": 1, "clients_per_round": 2, "batch_size": 32, "optimizer": {"lr": 0.05}},
                "engine": {"backend": "vectorized", "compile": True, "fuse_steps": 1, "threads": 1},
                "algorithm": {"name": "fedavg"}})
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    fed = build_federation(cfg)
    from fedmosaic.engine.client.compiled import CompileCache
    warm = CompileCache.default().warm(fed.groups[0].compile_key)
    rec = fed.round(0)
print(json.dumps({"loss": rec["train_loss"], "hit": counters["inductor"]["fxgraph_cache_hit"],
                  "miss": counters["inductor"]["fxgraph_cache_miss"], "warm": warm,
                  "said": [str(w.message) for w in said if str(w.message).startswith("engine.compile")]}))
"""


def compiled_round(tmp_path, hidden: int = 6) -> tuple[dict, str]:
    env = {**os.environ, "FEDMOSAIC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", CHILD, str(hidden)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.slow
def test_a_warm_cache_serves_the_same_graphs_and_a_changed_model_or_a_damaged_entry_is_compiled_again(tmp_path):
    cold, _ = compiled_round(tmp_path)
    assert cold["miss"] > 0 and cold["hit"] == 0 and not cold["warm"]
    warm, _ = compiled_round(tmp_path)
    assert warm["warm"] and warm["hit"] > 0 and warm["miss"] == 0  # every graph from the cache
    assert warm["loss"] == cold["loss"]  # the same kernels: the same numbers
    other, _ = compiled_round(tmp_path, hidden=7)  # another shape: another setting, never the first one's graphs
    assert not other["warm"] and other["miss"] > 0
    root = next((tmp_path / "cache" / "compile").iterdir())
    for p in root.rglob("*"):
        if p.is_file() and p.name != "fedmosaic-manifest.json":
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])  # every entry cut short
    again, stderr = compiled_round(tmp_path)
    assert again["loss"] == cold["loss"] and again["miss"] > 0 and again["hit"] == 0
    assert len(again["said"]) == 1 and "damaged entries of the compile cache" in again["said"][0], again["said"]
    assert "Traceback" not in stderr and "UnpicklingError" not in stderr  # torch never read a damaged entry


def test_a_resume_counts_on_the_warm_up_its_run_started_with(tmp_path, monkeypatch):
    """Which warm-up ``compile: auto`` counted on is recorded (``meta.json``): a resume decides as its run started,
    whatever the cache came to hold meanwhile, so it continues with the execution it began with."""
    from fedtest import BLOBS8, with_overrides

    from fedmosaic.runs import runner
    from fedmosaic.runs.dirs import started_warm
    from fedmosaic.setup.world import build_federation

    monkeypatch.setenv("FEDMOSAIC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cfg, out = with_overrides(BLOBS8, checkpoint_every=1), tmp_path / "run"
    runner.run(cfg, out, progress=False, stop_after=0)
    assert started_warm(out) == (False,)
    CompileCache.default().record(build_federation(cfg).groups[0].compile_key)  # the setting compiled elsewhere
    assert build_federation(cfg).groups[0].execution.warm  # a new run counts on the cache
    built = []
    real = runner.build_federation
    monkeypatch.setattr(runner, "build_federation", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    runner.run(cfg, out, resume=True, progress=False)
    assert [g.execution.warm for g in built[0].groups] == [False]
    assert json.loads((out / "meta.json").read_text())["execution"][0]["compile_warm"] is False
