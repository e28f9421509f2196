"""Client-level DP-FedAvg beside the non-private run (issue 38; docs/results.md "Client-level differential
privacy"): FedAvg on the APFL-PD MNIST preset (1000 power-law clients, logistic regression) with --per-round clients
a round, without privacy and with each noise multiplier of --noise (clip --clip, delta 1e-5, adaptive clipping
with --adaptive); per round the test accuracy and the epsilon spent, one PNG of both, a JSON of the finals. Every
run is an ordinary run directory under --out (a finished one is not run again).

    FEDMOSAIC_DATA=../shared/data OMP_NUM_THREADS=1 python benchmarks/dp_mnist.py --out runs/dp-mnist \\
        --json benchmarks/results-dp-mnist.json --plot docs/img/dp_mnist.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fedmosaic.config import load_config  # noqa: E402
from fedmosaic.presets import preset_path  # noqa: E402
from fedmosaic.runs.records import read_metrics  # noqa: E402
from fedmosaic.runs.runner import run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/dp-mnist")
    p.add_argument("--noise", type=float, nargs="+", default=[0.5, 1.0])
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--per-round", type=int, default=100)
    p.add_argument("--rounds", type=int, help="instead of the preset's 150")
    p.add_argument("--adaptive", action="store_true", help="adaptive clipping (quantile 0.5, count noise m/20)")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    base = ["compare=null", "algorithm={name: fedavg}", f"train.clients_per_round={args.per_round}",
            ] + ([f"train.rounds={args.rounds}"] if args.rounds else [])
    runs = {"non-private": None}
    for z in args.noise:
        adaptive = f", adaptive: {{count_noise: {args.per_round / 20}}}" if args.adaptive else ""
        runs[f"sigma {z:g}"] = f"privacy={{noise: {z}, clip: {args.clip}{adaptive}}}"
    out, results = Path(args.out), {}
    fig, (acc_ax, eps_ax) = plt.subplots(1, 2, figsize=(10.4, 4.2), layout="constrained")
    for i, (name, priv) in enumerate(runs.items()):  # (one colour per run in both panels)
        where = out / name.replace(" ", "-")
        cfg = load_config(preset_path("apfl-mnist"), base + ([priv] if priv else []))
        if not (where / "summary.json").is_file():
            run(cfg, where, resume=(where / "config.yaml").is_file(), progress=False)
        recs = read_metrics(where)
        x = [r["round"] + 1 for r in recs]
        acc_ax.plot(x, [100 * r["global_clients"]["acc"] for r in recs], label=name, color=f"C{i}")
        if priv:
            eps_ax.plot(x, [r["privacy"]["epsilon"] for r in recs], label=name, color=f"C{i}")
        results[name] = {"final": recs[-1]["global_clients"]["acc"], "epsilon": recs[-1].get("privacy", {}).get("epsilon"),
                         "clip": recs[-1].get("privacy", {}).get("clip")}
        print(name, results[name], flush=True)
    acc_ax.set(xlabel="rounds", ylabel="global model on the clients' test data (%)", title="FedAvg, APFL MNIST, 1000 clients")
    eps_ax.set(xlabel="rounds", ylabel="epsilon (delta 1e-5)", title=f"{args.per_round} clients a round, clip "
               f"{args.clip:g}" + (" (adaptive)" if args.adaptive else ""))
    for ax in (acc_ax, eps_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    if args.plot:
        fig.savefig(args.plot, dpi=110)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
