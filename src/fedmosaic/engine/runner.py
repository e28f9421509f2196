"""Runs: a run directory with the resolved config, metadata, metrics.jsonl, checkpoints and summary.json.

Nothing a user produced is overwritten: a new run refuses an existing non-empty directory; ``resume`` continues a
directory from its last checkpoint and, because every random choice derives from (seed, round, client), finishes
with exactly the metrics of an uninterrupted run (timing fields aside).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import yaml

from .. import __version__
from ..config import RunConfig, dump, validate
from ..errors import FedMosaicError
from ..data.federated import FederatedData
from .federation import Federation, NonFiniteLoss

TIMING_KEYS = ("time_round_s", "time_eval_s")
KEEP_CHECKPOINTS = 2


def new_run_dir(root: str | Path, name: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{name}-{stamp}"
    path, i = base, 1
    while path.exists():
        path, i = base.with_name(f"{base.name}-{i}"), i + 1
    return path


def _atomic_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _save_checkpoint(out: Path, fed: Federation, round_done: int) -> Path:
    ck = out / "checkpoints"
    ck.mkdir(exist_ok=True)
    path = ck / f"round_{round_done:05d}.pt"
    fd, tmp = tempfile.mkstemp(dir=ck, suffix=".tmp")
    os.close(fd)
    torch.save({"round": round_done, **fed.state_dict()}, tmp)
    os.replace(tmp, path)
    for old in sorted(ck.glob("round_*.pt"))[:-KEEP_CHECKPOINTS]:
        old.unlink()
    return path


def latest_checkpoint(out: Path) -> Path | None:
    found = sorted((out / "checkpoints").glob("round_*.pt"))
    return found[-1] if found else None


def read_metrics(out: Path) -> list[dict]:
    p = out / "metrics.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def summarize(records: list[dict], cfg: RunConfig) -> dict:
    """Headline numbers. Never "best on test": the best round is chosen on validation accuracy when there is one."""
    ev = [r for r in records if any(k in r for k in ("global", "global_clients", "personal"))]
    out: dict = {"name": cfg.name, "algorithm": cfg.algorithm.name, "rounds": len(records)}
    for key in ("global", "global_clients", "personal"):
        accs = [r[key]["acc"] for r in ev if key in r]
        if accs:
            out[f"{key}_acc_final"] = accs[-1]
            out[f"{key}_acc_mean"] = float(np.mean(accs))
    if ev and "personal" in ev[-1]:
        out["personal_acc_worst10_final"] = ev[-1]["personal"]["acc_worst10"]
    val = [r for r in ev if "global_val" in r and "global" in r]
    if val:
        best = max(val, key=lambda r: r["global_val"]["acc"])  # first round with the best validation accuracy
        out["global_acc_best_by_val"] = best["global"]["acc"]
        out["best_round_by_val"] = best["round"]
    history = [r["global"]["class_acc"] for r in ev if "global" in r]
    if len(history) > 1:
        out["forgetting"] = forgetting(history)
    out["bytes_per_round"] = float(np.mean([r["bytes_up"] + r["bytes_down"] for r in records])) if records else 0.0
    out["wall_time_s"] = float(sum(r.get("time_round_s", 0) + r.get("time_eval_s", 0) for r in records))
    return out


def forgetting(class_acc_history: list[list[float]]) -> float:
    """FedNTD eq. 5: F = (1/C) Σ_c max_{t<T} (A_c^t − A_c^T), from the global model's per-class test accuracy."""
    a = np.asarray(class_acc_history)
    return float((a[:-1].max(0) - a[-1]).mean())


def _meta(cfg: RunConfig, fed: Federation) -> dict:
    return {
        "fedmosaic": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "seed": cfg.seed,
        "data_hash": fed.fd.hash,
        "num_clients": fed.num_clients,
        "device": str(fed.device),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def run(cfg: RunConfig, out: str | Path, *, resume: bool = False, progress: bool = True,
        stop_after: int | None = None, fd: FederatedData | None = None) -> dict:
    """Run (or resume) ``cfg`` in directory ``out``. ``stop_after``: stop once that round is done (as if killed)."""
    out = Path(out)
    start = 0
    if resume:
        if not (out / "config.yaml").exists():
            raise FedMosaicError(f"--resume: {out} is not a run directory (no config.yaml)")
        saved = validate(yaml.safe_load((out / "config.yaml").read_text()))
        if saved != cfg:
            raise FedMosaicError(f"--resume: the config differs from the one saved in {out}/config.yaml")
    elif out.exists() and any(out.iterdir()):
        raise FedMosaicError(f"run directory {out} already exists; use --resume to continue it or choose another --out")
    fed = Federation(cfg, fd)  # before creating anything: a config or data error leaves no empty run directory
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    if resume:
        ck = latest_checkpoint(out)
        if ck is not None:
            state = torch.load(ck, weights_only=True, map_location=fed.device)
            fed.load_state_dict(state)
            start = state["round"] + 1
        records = [r for r in read_metrics(out) if r["round"] < start]
        _atomic_bytes(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode())
    else:
        _atomic_bytes(out / "config.yaml", dump(cfg).encode())
        _atomic_bytes(out / "meta.json", json.dumps(_meta(cfg, fed), indent=2).encode())
    rounds = cfg.train.rounds
    bar = _progress(range(start, rounds), cfg.name, progress, start, rounds)
    with open(out / "metrics.jsonl", "a") as metrics:
        for t in bar:
            t0 = time.perf_counter()
            try:
                rec = fed.round(t)
            except NonFiniteLoss as e:
                last = latest_checkpoint(out)
                if last is None or int(last.stem.split("_")[1]) != t - 1:
                    last = _save_checkpoint(out, fed, t - 1) if t > 0 else None
                raise FedMosaicError(
                    f"{e}; stopped. Last good state: {last if last else 'none (failed in round 0)'}. "
                    "Lower the learning rate or check the data normalisation."
                ) from None
            rec["time_round_s"] = time.perf_counter() - t0
            if (t + 1) % cfg.eval.every == 0 or t == rounds - 1:
                t1 = time.perf_counter()
                rec.update(fed.evaluate())
                rec["time_eval_s"] = time.perf_counter() - t1
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
            records.append(rec)
            if (t + 1) % cfg.checkpoint_every == 0 or t == rounds - 1:
                _save_checkpoint(out, fed, t)
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(_postfix(rec), refresh=False)
            if stop_after is not None and t >= stop_after:
                return {}
    summary = summarize(records, cfg)
    _atomic_bytes(out / "summary.json", json.dumps(summary, indent=2).encode())
    return summary


def _postfix(rec: dict) -> dict:
    post = {"loss": f"{rec['train_loss']:.3f}"}
    for key in ("global", "personal"):
        if key in rec:
            post[f"acc_{key[0]}"] = f"{rec[key]['acc']:.3f}"
    return post


def _progress(it, name, enabled, start, total):
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=name, initial=start, total=total, unit="round", dynamic_ncols=True)
