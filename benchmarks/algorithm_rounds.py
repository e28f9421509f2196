"""Seconds per round of algorithms on a preset, each under the engine settings given, in one process: what an
algorithm's objective and the execution path cost (e.g. pFedMe's K + 1 updates a step eager and compiled).

Usage:  FEDMOSAIC_DATA=../shared/data OMP_NUM_THREADS=1 python benchmarks/algorithm_rounds.py pfedsrb-mnist-dir0.1 \\
            --algorithms pfedme pfedsrb --engines compile=false compile=true --rounds 3

Each (algorithm, engine) is built with the preset's ``train.rounds`` (so ``compile: auto`` decides as for the full
run), trains round 0 (any compiling: reported apart) and then ``--rounds`` more, timed.
"""

from __future__ import annotations

import argparse
import json
import time

from fedmosaic.config import load_config, validate
from fedmosaic.presets import preset_path
from fedmosaic.setup.world import build_federation


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("--algorithms", nargs="+", required=True)
    ap.add_argument("--engines", nargs="+", default=["compile=false"], help="engine.KEY=VALUE[,KEY=VALUE] each")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for alg in args.algorithms:
        for engine in args.engines:
            sets = [f"engine.{kv}" for kv in engine.split(",")]
            raw = load_config(preset_path(args.preset), sets).model_dump(mode="json")
            raw.pop("compare", None)
            raw["algorithm"], raw["eval"] = {"name": alg}, {**raw["eval"], "every": 10**6}
            fed = build_federation(validate(raw))
            t0 = time.perf_counter()
            fed.round(0)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            for t in range(1, args.rounds + 1):
                fed.round(t)
            print(json.dumps({"algorithm": alg, "engine": engine, "first_round_s": round(first, 2),
                              "s_per_round": round((time.perf_counter() - t0) / args.rounds, 3),
                              "execution": fed.execution}), flush=True)


if __name__ == "__main__":
    main()
