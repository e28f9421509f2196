"""Scale-out on Ray (``engine.pool: ray``) against one process, in one run of this script.

  (same)  The same run — Ditto, an MLP, 1,000 clients of a synthetic 60-feature, 10-class dataset (the FedProx
          Synthetic(1, 1) recipe), 100 clients per round — in this process (``local``) and on 1 and 2 Ray actors:
          wall time of the rounds and of the final evaluation, and whether the metrics are the same (sequential
          backend: exactly; the default execution: within 1e-6).
  (big)   A population one process cannot hold in its memory budget: 100,000 Ditto clients with an MLP of 14,210
          parameters, every client's personal model kept between rounds (100,000 x 14,210 floats: 5.3 GiB), with
          ``engine.memory_mb`` as the budget of each process. The local executor refuses it up front (its one line
          is printed); on N actors each holds only its shard. Reported: the peak resident memory (VmHWM) of the
          driver and of every actor process, the wall time of start-up, rounds and the evaluation of all clients.

Each configuration starts its own Ray runtime on this machine (``ray.init``: the driver's process; the actors are
processes of their own) and stops it afterwards. Timings include no Ray start-up (reported apart).

Usage:  python benchmarks/ray_scale.py [--quick] [--only same|big] [--clients 100000] [--actors 2 4]
                                       [--memory-mb 4096] [--wire] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a benchmark: no token file written into the home directory

from fedmosaic.config import validate  # noqa: E402
from fedmosaic.data.registry import register_dataset  # noqa: E402
from fedmosaic.engine.pools.ray import peak_rss_mb  # noqa: E402
from fedmosaic.errors import FedMosaicError  # noqa: E402
from fedmosaic.setup.world import build_federation


def synthetic(n: int, seed: int = 0, features: int = 60, classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """FedProx's Synthetic(1, 1) in one pool: x ~ N(v, Sigma) with Sigma_jj = j^-1.2, labels of a random softmax
    model (the federated split is the partition's business here)."""
    rng = np.random.default_rng(seed)
    w, b = rng.normal(0, 1, (features, classes)), rng.normal(0, 1, classes)
    x = rng.normal(rng.normal(0, 1, features), np.arange(1, features + 1) ** -0.6, (n, features))
    return x.astype(np.float32), np.argmax(x @ w + b, axis=1).astype(np.int64)


def register(name: str, samples: int) -> str:
    """``samples`` of the synthetic data as the dataset ``name`` (a sixth of them its test split)."""
    x, y = synthetic(samples)
    n = samples * 5 // 6
    register_dataset(name, x[:n], y[:n], x[n:], y[n:], classes=10)
    return name


def config(dataset: str, clients: int, per_round: int, rounds: int, backend: str, pool: str, actors: int,
           memory_mb=None, client_test: float = 0.25, cpus: float = 1.0) -> dict:
    return {
        "name": f"ray-scale-{clients}", "seed": 0,
        "data": {"dataset": dataset, "clients": clients, "partition": {"scheme": "iid"},
                 "client_test": client_test},
        "model": {"name": "mlp", "options": {"hidden": 200}},
        "algorithm": {"name": "ditto"},
        "train": {"rounds": rounds, "clients_per_round": per_round, "local_epochs": 1, "batch_size": 10,
                  "optimizer": {"lr": 0.05}},
        "engine": {"backend": backend, "pool": pool, "memory_mb": memory_mb,
                   "ray": {"actors": actors, "cpus_per_actor": cpus}},
        "eval": {"every": rounds},
    }


def timed_run(raw: dict) -> dict:
    """Build, run every round, evaluate at the end; wall times and the records (no timings in them)."""
    cfg = validate(raw)
    with open("/proc/self/clear_refs", "w") as f:  # restart this process's peak RSS (VmHWM) from here
        f.write("5")
    t0 = time.perf_counter()
    fed = build_federation(cfg)
    built = time.perf_counter() - t0
    try:
        t1, recs = time.perf_counter(), []
        for t in range(cfg.train.rounds):
            recs.append(fed.round(t))
        rounds = time.perf_counter() - t1
        t2 = time.perf_counter()
        recs[-1].update(fed.evaluate(cfg.train.rounds - 1))
        evaluation = time.perf_counter() - t2
        actors = fed.pool.peak_rss_mb() if hasattr(fed.pool, "peak_rss_mb") else []
        where = fed.pool.meta().get("ray", {}).get("actors", [])
    finally:
        fed.pool.close()
    return {"start_s": built, "rounds_s": rounds, "eval_s": evaluation, "execution": fed.execution,
            "records": [{k: v for k, v in r.items() if not k.startswith("time")} for r in recs],
            "driver_peak_rss_mb": peak_rss_mb(), "actors_peak_rss_mb": actors, "where": where}


def differ(a, b, tol: float, at: str = "") -> list[str]:
    if isinstance(a, dict):
        return [d for k in sorted(set(a) | set(b)) for d in differ(a.get(k), b.get(k), tol, f"{at}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differ(x, y, tol, f"{at}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if abs(a - b) <= tol * max(1.0, abs(a)) else [f"{at}: {a} != {b}"]
    return [] if a == b else [f"{at}: {a!r} != {b!r}"]


def with_ray(fn):
    import ray

    ray.init(include_dashboard=False, log_to_driver=False, object_store_memory=1 << 30)
    try:
        return fn()
    finally:
        ray.shutdown()


def same(quick: bool) -> list[dict]:
    clients, per_round, rounds = (200, 50, 3) if quick else (1000, 100, 10)
    dataset, out = register("synthetic60-same", 36 * clients), []
    for backend, tol in (("sequential", 0.0), ("auto", 1e-6)):
        ref = None
        for pool, actors in (("local", 1), ("ray", 1), ("ray", 2)):
            raw = config(dataset, clients, per_round, rounds, backend, pool, actors)
            res = timed_run(raw) if pool == "local" else with_ray(lambda raw=raw: timed_run(raw))
            ref = ref or res
            diffs = differ(ref["records"], res["records"], tol)
            row = {"part": "same", "backend": backend, "pool": pool, "actors": actors if pool == "ray" else 0,
                   "clients": clients, "per_round": per_round, "rounds": rounds,
                   **{k: v for k, v in res.items() if k != "records"},
                   "same_as_local": not diffs, "tolerance": tol, "first_difference": diffs[:1],
                   "personal_acc": res["records"][-1]["personal"]["acc"]}
            out.append(row)
            print(f"same  {backend:10s} {pool:5s} x{row['actors']}: start {res['start_s']:.1f} s, rounds "
                  f"{res['rounds_s']:.1f} s, eval {res['eval_s']:.1f} s, personal acc {row['personal_acc']:.4f}, "
                  f"same as local: {row['same_as_local']}", flush=True)
    return out


def big(clients: int, actors: list[int], memory_mb: int, quick: bool, wire: bool = False) -> list[dict]:
    rounds = 2 if quick else 3
    dataset, out = register("synthetic60-big", 10 * clients), []  # ~4 train and 4 test samples per client
    raw = config(dataset, clients, 100, rounds, "auto", "local", 1, memory_mb, client_test=0.5)
    try:
        build_federation(validate(raw))
        refused = None
    except FedMosaicError as e:
        refused = str(e)
    print(f"big   local: {refused or 'NOT refused'}", flush=True)
    out.append({"part": "big", "pool": "local", "clients": clients, "memory_mb": memory_mb, "refused": refused})
    for n in actors:
        cpus = min(1.0, (os.cpu_count() or 1) / n)  # every actor placed on this machine
        raw = config(dataset, clients, 100, rounds, "auto", "ray", n, memory_mb, client_test=0.5, cpus=cpus)
        res = with_ray(lambda raw=raw: timed_run(raw))
        row = {"part": "big", "pool": "ray", "actors": n, "cpus_per_actor": cpus, "clients": clients,
               "memory_mb": memory_mb, "rounds": rounds, **{k: v for k, v in res.items() if k != "records"},
               "personal_acc": res["records"][-1]["personal"]["acc"],
               "evaluated_clients": res["records"][-1]["personal"]["clients"]}
        out.append(row)
        print(f"big   ray x{n}: start {res['start_s']:.1f} s, {rounds} rounds {res['rounds_s']:.1f} s, eval of "
              f"{row['evaluated_clients']:,} clients {res['eval_s']:.1f} s; peak RSS driver "
              f"{res['driver_peak_rss_mb']:,.0f} MiB, actors {[round(m) for m in res['actors_peak_rss_mb']]} MiB",
              flush=True)
    if wire:  # one process, a runtime per client built while it has messages (pools.WirePool), states in files
        res = timed_run(config(dataset, clients, 100, rounds, "auto", "wire", 1, memory_mb, client_test=0.5))
        out.append({"part": "big", "pool": "wire", "clients": clients, "memory_mb": memory_mb, "rounds": rounds,
                    **{k: v for k, v in res.items() if k != "records"},
                    "personal_acc": res["records"][-1]["personal"]["acc"],
                    "evaluated_clients": res["records"][-1]["personal"]["clients"]})
        print(f"big   wire: start {res['start_s']:.1f} s, {rounds} rounds {res['rounds_s']:.1f} s, eval of "
              f"{out[-1]['evaluated_clients']:,} clients {res['eval_s']:.1f} s; peak RSS "
              f"{res['driver_peak_rss_mb']:,.0f} MiB", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test of the script")
    ap.add_argument("--only", choices=("same", "big"))
    ap.add_argument("--clients", type=int, default=100_000, help="(big) the population")
    ap.add_argument("--actors", type=int, nargs="*", default=[2, 4], help="(big) the actor counts to run")
    ap.add_argument("--memory-mb", type=int, default=4096, help="(big) engine.memory_mb: each process's budget")
    ap.add_argument("--wire", action="store_true", help="(big) also the wire pool in this process (a runtime per "
                    "client, built while it has messages)")
    ap.add_argument("--json", help="write the rows there")
    args = ap.parse_args()
    rows = []
    if args.only in (None, "same"):
        rows += same(args.quick)
    if args.only in (None, "big"):
        rows += big(args.clients, args.actors, args.memory_mb, args.quick, args.wire)
    if args.json:
        meta = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                "python": sys.version.split()[0], "torch": torch.__version__,
                "ray": __import__("ray").__version__, "command": " ".join(sys.argv)}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
