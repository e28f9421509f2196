"""Defences against poisoned updates, each against each attack, on the same partition, cohorts and batches
(issue 38; docs/results.md "Robust aggregation"): FedAvg on MNIST (configs/robust-mnist.yaml), a seed-fixed 20% of
the clients scaling their update x1000 or flipping its sign, against no defence, a norm bound, the median, the
trimmed mean and Multi-Krum; the honest run beside them. Every run is an ordinary run directory under --out (a
finished one is not run again: the script resumes); the table (mean ± std over the seeds of the final and of the
mean-over-rounds accuracy) goes to --out/table.md and --json, the curves to --out/curves.png.

    FEDMOSAIC_DATA=../shared/data OMP_NUM_THREADS=1 python benchmarks/robust_mnist.py --out runs/robust-mnist \\
        --json benchmarks/results-robust-mnist.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from fedmosaic.config import load_config
from fedmosaic.reports.plots import learning_curves
from fedmosaic.runs.records import read_metrics
from fedmosaic.runs.runner import run

REPO = Path(__file__).resolve().parents[1]
ATTACKS = {"honest": None, "x1000": {"kind": "scale", "fraction": 0.2, "factor": 1000.0},
           "sign flip": {"kind": "sign_flip", "fraction": 0.2, "factor": 1.0}}
DEFENCES = {"none": None, "norm bound": {"rule": "norm_bound", "clip": 1.0}, "median": {"rule": "median"},
            "trimmed mean": {"rule": "trimmed_mean", "trim": 0.2}, "Multi-Krum": {"rule": "krum", "f": 4, "m": 10},
            "Bulyan": {"rule": "bulyan", "f": 4}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/robust-mnist")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, help="instead of the config's")
    p.add_argument("--json", help="write the table here too")
    args = p.parse_args()
    out = Path(args.out)
    rows, curves = [], {}
    for attack, a in ATTACKS.items():
        for defence, d in DEFENCES.items():
            if a is None and d is not None:
                continue  # the honest run once, without a defence
            name = f"{attack}, {defence}" if a is not None else "honest"
            per_seed = []
            for seed in args.seeds:
                where = out / name.replace(", ", "_").replace(" ", "-") / f"seed_{seed}"
                sets = [f"seed={seed}", f"attack={json.dumps(a)}", f"aggregation={json.dumps(d)}"]
                if args.rounds:
                    sets.append(f"train.rounds={args.rounds}")
                cfg = load_config(REPO / "configs/robust-mnist.yaml", sets)
                if not (where / "summary.json").is_file():
                    run(cfg, where, resume=(where / "config.yaml").is_file(), progress=False)
                per_seed.append(read_metrics(where))
            final = [r[-1]["global"]["acc"] for r in per_seed]
            mean = [np.mean([x["global"]["acc"] for x in r]) for r in per_seed]
            rows.append({"run": name, "final": float(np.mean(final)), "final_std": float(np.std(final, ddof=1))
                         if len(final) > 1 else 0.0, "mean": float(np.mean(mean)),
                         "mean_std": float(np.std(mean, ddof=1)) if len(mean) > 1 else 0.0, "seeds": len(final)})
            curves[name] = per_seed
            print(f"{name:28s} final {100 * rows[-1]['final']:6.2f} ± {100 * rows[-1]['final_std']:.2f}   "
                  f"mean over rounds {100 * rows[-1]['mean']:6.2f} ± {100 * rows[-1]['mean_std']:.2f}", flush=True)
    table = ["| attack, defence | final accuracy | mean over rounds |", "|---|---|---|"]
    table += [f"| {r['run']} | {100 * r['final']:.2f} ± {100 * r['final_std']:.2f} | "
              f"{100 * r['mean']:.2f} ± {100 * r['mean_std']:.2f} |" for r in rows]
    (out / "table.md").write_text("\n".join(table) + "\n")
    learning_curves(curves, out / "curves.png", title=f"FedAvg, MNIST, 20% attackers; seeds {args.seeds}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
