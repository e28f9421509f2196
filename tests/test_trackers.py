"""``eval.trackers``: MLflow (a SQLite store in the run) and Weights & Biases (offline), the real libraries, read
back: every round's numbers at step = rounds done, the config, the summary, one tracker run across a resume; a
missing package is one line before anything is written."""

from __future__ import annotations

import glob
import json
import struct
import sys

import pytest
from fedtest import BLOBS6, merged, with_overrides

from fedmosaic.cli.main import main
from fedmosaic.runs.records import read_metrics
from fedmosaic.runs.runner import run

pytest.importorskip("mlflow")
pytest.importorskip("wandb")


def wandb_records(run_dir) -> tuple[list[dict], dict]:
    """(history rows, summary) of every offline W&B run file under ``run_dir`` (the LevelDB-log framing of
    W&B's .wandb files: 32 KiB blocks, records of crc32, length, type, then protobuf ``Record`` s)."""
    from wandb.proto import wandb_internal_pb2 as pb

    history, summary = [], {}
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        raw, pos, buf = open(path, "rb").read(), 7, b""
        while pos + 7 <= len(raw):
            if 32768 - pos % 32768 < 7:
                pos += 32768 - pos % 32768
                continue
            _, n, kind = struct.unpack("<IHB", raw[pos : pos + 7])
            if n == 0 and kind == 0:
                break
            buf, pos = buf + raw[pos + 7 : pos + 7 + n], pos + 7 + n
            if kind not in (1, 4):  # FIRST / MIDDLE of a record
                continue
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            which = rec.WhichOneof("record_type")
            if which == "history":
                history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
            elif which == "summary":
                summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.summary.update})
    return history, summary


@pytest.fixture
def wandb_service():
    """W&B runs its runs through a service process it starts at the first init: stopped when the test ends."""
    import wandb

    yield
    wandb.teardown()


def test_mlflow_and_wandb_get_every_round_the_config_and_the_summary_across_a_resume(tmp_path, monkeypatch,
                                                                                    wandb_service):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = with_overrides(merged(BLOBS6, {"train": {"rounds": 3}, "checkpoint_every": 1,
                                         "eval": {"trackers": ["mlflow", "wandb"]}}))
    out = tmp_path / "run"
    run(cfg, out, progress=False, stop_after=1)  # "killed" after round 1
    run(cfg, out, progress=False, resume=True)
    accs = {r["round"] + 1: r["global"]["acc"] for r in read_metrics(out) if "global" in r}
    assert len(accs) == 3
    ids = json.loads((out / "trackers.json").read_text())
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (exp,) = [e for e in client.search_experiments() if e.name == cfg.name]
    (one,) = client.search_runs([exp.experiment_id])  # one tracker run across the resume
    assert one.info.run_id == ids["mlflow"] and one.info.status == "FINISHED"
    got = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], "global/acc")}
    assert got == pytest.approx(accs)
    assert one.data.params["algorithm.name"] == "fedavg" and one.data.params["train.rounds"] == "3"
    assert float(one.data.tags["summary/global_acc_final"]) == pytest.approx(
        json.loads((out / "summary.json").read_text())["global_acc_final"])
    history, summary = wandb_records(out)
    steps = {h["_step"]: h["global/acc"] for h in history if "global/acc" in h}
    assert steps == pytest.approx(accs)
    assert summary["global_acc_final"] == pytest.approx(float(one.data.tags["summary/global_acc_final"]))


def test_a_tracker_whose_package_is_missing_is_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
    out = tmp_path / "run"
    assert main(["run", "--no-progress", "--out", str(out), "--set", "compare=null",
                 "--set", "eval.trackers=[mlflow]"]) != 0
    err = capsys.readouterr().err.strip()
    assert "pip install 'fedmosaic[mlflow]'" in err and "\n" not in err
    assert not out.exists()


def test_a_wandb_mode_wandb_would_refuse_is_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "bogus")
    out = tmp_path / "run"
    assert main(["run", "--no-progress", "--out", str(out), "--set", "compare=null",
                 "--set", "eval.trackers=[wandb]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedmosaic: error: WANDB_MODE: one of online, offline") and "\n" not in err, err
    assert not out.exists()


def test_a_tracking_uri_mlflow_has_no_store_for_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://x")
    assert main(["run", "--no-progress", "--out", str(tmp_path / "run"), "--set", "compare=null",
                 "--set", "train.rounds=1", "--set", "eval.trackers=[mlflow]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedmosaic: error: eval.trackers: mlflow could not start: ") and "\n" not in err, err


def test_a_resume_whose_tracker_runs_are_gone_or_whose_ids_are_damaged_goes_on_in_new_tracker_runs(tmp_path,
                                                                                                 monkeypatch):
    """trackers.json damaged, or the MLflow store it points into gone (deleted, or another MLFLOW_TRACKING_URI): the
    resume stopped with an internal error. Now a warning, and the run finishes with its metrics unchanged."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = with_overrides(merged(BLOBS6, {"train": {"rounds": 3}, "checkpoint_every": 1,
                                         "eval": {"trackers": ["mlflow"]}}))
    full = tmp_path / "full"
    run(cfg, full, progress=False)
    for i, (damage, warned) in enumerate((("{bad", "trackers.json is damaged"), ("[1]", "trackers.json is damaged"),
                                          (None, "MLflow has no run"))):
        out = tmp_path / f"r{i}"
        run(cfg, out, progress=False, stop_after=1)
        if damage is None:  # (a deleted store in another process is the same: MLflow caches its engine here)
            monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'elsewhere.db'}")
        else:
            (out / "trackers.json").write_text(damage)
        with pytest.warns(UserWarning, match=warned):
            run(cfg, out, progress=False, resume=True)
        assert [r["global"] for r in read_metrics(out)] == [r["global"] for r in read_metrics(full)]
        ids = json.loads((out / "trackers.json").read_text())
        client = MlflowClient(f"sqlite:///{tmp_path / 'elsewhere.db' if damage is None else out / 'mlflow.db'}")
        assert client.get_run(ids["mlflow"]).info.status == "FINISHED"
        assert damage is None or (out / "trackers.json.corrupt").read_text() == damage
