"""Several algorithms on the same partition, cohorts and batch order; one table and one PNG of learning curves."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..config import RunConfig, dump
from ..data.federated import build
from ..engine.federation import data_spec
from ..engine.runner import read_metrics, run
from ..errors import FedMosaicError
from .plots import learning_curves

COLUMNS = (
    ("algorithm", "name", "{}"),
    ("global acc", "global_acc_final", "{:.2%}"),
    ("mean over rounds", "global_acc_mean", "{:.2%}"),
    ("best-by-val", "global_acc_best_by_val", "{:.2%}"),
    ("F", "forgetting", "{:.3f}"),
    ("clients acc", "global_clients_acc_final", "{:.2%}"),
    ("personal acc", "personal_acc_final", "{:.2%}"),
    ("worst 10%", "personal_acc_worst10_final", "{:.2%}"),
    ("bytes/round", "bytes_per_round", "{:,.0f}"),
    ("wall s", "wall_time_s", "{:.1f}"),
)


def dir_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", label).strip("_")


def run_all(cfg: RunConfig, out: Path, *, resume: bool = False, progress: bool = True) -> list[dict]:
    """Run ``cfg`` (each of its ``compare`` variants in a sub-directory); write table, JSON and learning curves."""
    variants = cfg.variants()
    if len(variants) == 1:
        summaries = [run(cfg, out, resume=resume, progress=progress)]
        curves = {cfg.name: read_metrics(out)}
    else:
        fd = build(data_spec(cfg))  # one partition for all: same clients, same samples
        if not resume and out.exists() and any(out.iterdir()):
            raise FedMosaicError(f"run directory {out} already exists; use --resume to continue it or choose another --out")
        out.mkdir(parents=True, exist_ok=True)
        if not resume:
            (out / "comparison.yaml").write_text(dump(cfg))
        summaries, curves = [], {}
        for v in variants:
            sub = out / dir_name(v.name)
            summaries.append(run(v, sub, resume=resume and (sub / "config.yaml").exists(), progress=progress, fd=fd))
            curves[v.name] = read_metrics(sub)
    (out / "comparison.json").write_text(json.dumps(summaries, indent=2))
    learning_curves(curves, out / "learning_curves.png", title=f"{cfg.name}: {cfg.data.dataset}")
    return summaries


def table(summaries: list[dict]) -> str:
    cols = [(h, k, f) for h, k, f in COLUMNS if any(k in s for s in summaries)]
    rows = [[h for h, _, _ in cols]] + [[f.format(s[k]) if k in s else "-" for _, k, f in cols] for s in summaries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
