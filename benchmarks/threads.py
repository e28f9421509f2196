"""CPU threads beside other work: a model-heterogeneous run with fedmosaic's default threads, with one thread, and
with the previous default (torch's own thread count), each while another process keeps one core busy,
and again with no such process. One script, one machine, alternating the variants.

Every run is a fresh ``fedmosaic run`` process (the default is chosen when a process starts), timed from start to
finish, with ``OMP_NUM_THREADS`` and ``FEDMOSAIC_PARALLEL_RUNS`` removed from its environment. The busy core is a
Python busy loop at normal priority, started before the runs and killed by its process id at the end (also when a
run fails). The run: scikit-learn's digits (no download), 6 clients Dirichlet(0.5), FedMD on 200 noise images,
ResNet-10 and ResNet-12 at width 0.25 and an MLP, one warm-up epoch and 3 rounds.

Usage:  python benchmarks/threads.py [--repeat 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

CONFIG = {
    "name": "threads-bench", "seed": 0,
    "data": {"dataset": "digits", "clients": 6, "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_size": 20},
             "client_test": 0.25, "public": {"source": "noise", "size": 200}},
    "model": {"heterogeneous": [{"name": "resnet10", "options": {"width": 0.25}},
                                {"name": "mlp", "options": {"hidden": 200}},
                                {"name": "resnet12", "options": {"width": 0.25}}]},
    "algorithm": {"name": "fedmd"},
    "train": {"rounds": 3, "clients_per_round": 6, "local_epochs": 1, "batch_size": 32, "warmup_epochs": 1,
              "optimizer": {"name": "adam", "lr": 0.001}},
    "eval": {"global_test": False},
}
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "FEDMOSAIC_PARALLEL_RUNS")}


def torch_default_threads() -> int:
    """What torch chooses by itself in a fresh process (fedmosaic's default before it chose)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=CLEAN_ENV,
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def one_run(cfg_path: Path, sets: list[str], env: dict) -> dict:
    exe = Path(sys.executable).with_name("fedmosaic")
    with tempfile.TemporaryDirectory() as tmp:
        argv = [str(exe), "run", str(cfg_path), "--no-progress", "--out", f"{tmp}/run"]
        for item in sets:
            argv += ["--set", item]
        t0 = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, env={**CLEAN_ENV, **env}, check=False)
        wall = time.perf_counter() - t0
        if done.returncode:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr[-2000:]}")
        summary = json.loads(Path(f"{tmp}/run/summary.json").read_text())
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("fedmosaic: execution: "))
    return {"wall_s": wall, "threads": line.rsplit("; ", 1)[-1], "acc": summary.get("personal_acc_final")}


def busy_core() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2, help="alternate the variants this many times")
    ap.add_argument("--json", help="write the raw numbers here")
    args = ap.parse_args()
    before = torch_default_threads()
    # the previous default: torch's threads for the process (given as OMP_NUM_THREADS, which fedmosaic keeps, so
    # that tiny dense steps still train on one thread as they did)
    variants = {"default": ([], {}), "one thread": (["engine.threads=1"], {}),
                "previous default": ([], {"OMP_NUM_THREADS": str(before)})}
    res = {"machine": platform.platform(), "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
           "date": time.strftime("%Y-%m-%d %H:%M"), "load_at_start": os.getloadavg(), "scenarios": {}}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "threads-bench.yaml"
        cfg.write_text(yaml.safe_dump(CONFIG))
        for scenario in ("beside a busy core", "no busy core"):
            busy = busy_core() if scenario == "beside a busy core" else None
            try:
                time.sleep(1.0)  # the loop runs
                runs = res["scenarios"][scenario] = {}
                for _ in range(args.repeat):
                    for name, (sets, env) in variants.items():
                        r = one_run(cfg, sets, env)
                        r["load_1min"] = os.getloadavg()[0]
                        runs.setdefault(name, []).append(r)
                        print(json.dumps({scenario: {name: r}}), flush=True)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
    res["load_at_end"] = os.getloadavg()
    print_table(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


def print_table(res: dict) -> None:
    print("\n| scenario | threads | median wall s | each run (s) | vs one thread | final personal acc |")
    print("|---|---|---|---|---|---|")
    for scenario, runs in res["scenarios"].items():
        one = np.median([r["wall_s"] for r in runs["one thread"]])
        for name, rs in runs.items():
            walls = [r["wall_s"] for r in rs]
            chosen = "; ".join(sorted({r["threads"] for r in rs}))
            each = ", ".join(f"{w:.1f}" for w in walls)
            accs = ", ".join(f"{r['acc']:.4f}" for r in rs)
            print(f"| {scenario} | {name}: {chosen} | {np.median(walls):.1f} | {each} | {np.median(walls) / one:.2f}x "
                  f"| {accs} |")


if __name__ == "__main__":
    main()
