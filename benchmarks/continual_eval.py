"""Continual evaluation cost per task: the previous implementation (every client's own model on every test sample of
the classes seen so far) against the default (at most ``eval.continual_sample`` predictions, each model judging its
share of a fixed class-stratified sample) and the exact option (``eval.continual_sample: null``), in one process.

CIFAR-100, 10 tasks of 10 classes (one shared order), 10 IID clients each predicting with its own model (ProtoFCL by
default), the FedAvg CNN; one round of one local epoch per task (the models only need to be what a run has at each
task end: an evaluation's cost does not depend on how well they are trained). After each task's round the three
evaluations run on the same models, the default three times around the other two (whose order alternates from
task to task) so that drifts of a busy machine hit all alike; each is timed alone (``time.perf_counter`` around
``Federation._continual``), and the default's time per task is the median of its three.

The previous implementation is kept here as it was (``old_continual``: ``evaluate.stacked_correct`` of every model on
all seen samples, the hits averaged over the models); its numbers are the exact option's.

With ``--checkpoint``, instead: a finished run's trained models, evaluated in full and with the default's sample
(under several sampling seeds), to show how far the sample's numbers are from the exact ones.

Usage:  FEDMOSAIC_DATA=../shared/data python benchmarks/continual_eval.py [--algorithm protofcl] [--json out.json]
        FEDMOSAIC_DATA=../shared/data python benchmarks/continual_eval.py --checkpoint RUN/checkpoints/round_N.pt
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from fedmosaic.config import load_config, validate
from fedmosaic.engine import evaluate as ev
from fedmosaic.engine.federation import Federation
from fedmosaic.setup.groups import data_spec
from fedmosaic.setup.world import build_federation


def config(algorithm: str, tasks: int, clients: int, sample: int | None) -> object:
    return validate({
        "seed": 0,
        "data": {"dataset": "cifar100", "clients": clients, "partition": {"scheme": "iid"},
                 "tasks": {"n_tasks": tasks, "rounds_per_task": 1, "order": "shared"}},
        "model": {"name": "fedavg_cnn"},
        "algorithm": {"name": algorithm},
        "train": {"rounds": tasks, "clients_per_round": clients, "local_epochs": 1, "batch_size": 64,
                  "optimizer": {"lr": 0.01}},
        "eval": {"client_test": False, "continual_sample": sample},
    })


def old_continual(fed: Federation, t: int) -> dict:
    """``Federation._continual`` before this change: every model on every test sample of the seen classes."""
    stage = fed.stage(t)
    first = fed.first_met(stage)
    seen = first <= stage
    x, y = fed.global_test
    keep = torch.as_tensor(seen, device=fed.device)[y]
    x, y = x[keep], y[keep]
    unseen = torch.as_tensor(~seen, device=fed.device)

    def masked(z, logits):
        return fed.algo.eval_logits(z, logits, fed.algo.broadcast(fed.server, 0)).masked_fill(unseen, float("-inf"))

    ok = []
    for g in fed.groups[:1] if fed.algo.global_model else fed.groups:
        g.module.eval()
        params, bufs = fed.predictors(g, t, 1 if fed.algo.global_model else None)
        ok.append(ev.stacked_correct(g.apply, {**params, **bufs}, x, y, fed.transform, g.trainer.vectorize,
                                     logits_fn=masked).double())
    hit = torch.cat(ok).mean(0)
    group = torch.as_tensor(first, device=fed.device)[y]
    tasks = [float(hit[group == j].mean()) if (group == j).any() else None for j in range(stage + 1)]
    return {"stage": stage, "seen_acc": float(hit.mean()), "tasks": tasks}


def with_sample(fed: Federation, sample: int | None) -> None:
    s = fed.settings
    fed.world.settings = replace(s, eval=s.eval.model_copy(update={"continual_sample": sample}))


def trained(checkpoint: Path, seeds: int) -> dict:
    """A finished run's models (its checkpoint at a task end): the full evaluation against the default's sample
    drawn with ``seeds`` different sampling seeds (the run's own data seed first) — how far the sample's numbers are
    from the exact ones on trained models."""
    run_dir = checkpoint.parent.parent
    fed = build_federation(load_config(run_dir / "config.yaml"))
    state = torch.load(checkpoint, weights_only=True, map_location=fed.device)
    fed.load_state_dict(state)
    t = state["round"]
    with_sample(fed, None)
    t0 = time.perf_counter()
    full = fed._continual(t)
    res = {"run": str(run_dir), "round": t, "full": {**full, "eval_s": time.perf_counter() - t0}, "sampled": []}
    with_sample(fed, validate({}).eval.continual_sample)
    for s in range(seeds):
        if s:  # another fixed sample: the ranks from another seed
            fed.test_ranks = ev.class_ranks(fed.fd.y_global, data_spec(fed.cfg).seed + s)
        t0 = time.perf_counter()
        out = fed._continual(t)
        res["sampled"].append({**out, "eval_s": time.perf_counter() - t0})
    seen = [o["seen_acc"] - full["seen_acc"] for o in res["sampled"]]
    rows = np.array([o["tasks"] for o in res["sampled"]]) - np.array(full["tasks"])
    res["seen_acc_diff"] = {"mean": float(np.mean(seen)), "std": float(np.std(seen)), "max_abs": float(np.abs(seen).max())}
    res["task_row_diff"] = {"std": float(rows.std(0).mean()), "max_abs": float(np.abs(rows).max())}
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--algorithm", default="protofcl")
    ap.add_argument("--tasks", type=int, default=10)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--json", help="write the raw numbers here")
    ap.add_argument("--checkpoint", type=Path, help="instead: a finished continual run's checkpoint (at a task end), "
                    "evaluated in full and with the default's sample under --seeds sampling seeds")
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    load_at_start = os.getloadavg()
    if args.checkpoint:
        res = trained(args.checkpoint, args.seeds)
        if args.json:
            Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "load_at_start":
                                                   load_at_start, "load_at_end": os.getloadavg(), **res}, indent=2))
        return
    default = validate({}).eval.continual_sample
    fed = build_federation(config(args.algorithm, args.tasks, args.clients, default))
    print(f"execution: {fed.execution}", flush=True)
    ways = {"old": lambda t: old_continual(fed, t),
            "full": lambda t: (with_sample(fed, None), fed._continual(t))[1],
            "default": lambda t: (with_sample(fed, default), fed._continual(t))[1]}
    rows = []
    for t in range(args.tasks):
        t0 = time.perf_counter()
        fed.round(t)
        row = {"task": t + 1, "train_s": time.perf_counter() - t0, "load": os.getloadavg()[0],
               "seen_samples": int(fed.seen_classes(fed.stage(t))[fed.fd.y_global].sum())}
        # the default three times around the other two (their order alternating): its median per task
        for name in ("default", "old", "default", "full", "default") if t % 2 else \
                ("default", "full", "default", "old", "default"):
            t0 = time.perf_counter()
            out = ways[name](t)
            took = time.perf_counter() - t0
            entry = row.setdefault(name, {"each_s": [], "seen_acc": out["seen_acc"], "tasks": out["tasks"],
                                          **({"sample": out["sample"]} if "sample" in out else {})})
            entry["each_s"].append(took)
            entry["eval_s"] = float(np.median(entry["each_s"]))
        # the exact option computes the previous implementation's numbers
        row["full_equals_old"] = all(np.allclose(row["full"][k], row["old"][k], atol=1e-12) for k in ("seen_acc", "tasks"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count(),
                       "threads": torch.get_num_threads(), "execution": fed.execution,
                       "date": time.strftime("%Y-%m-%d %H:%M"), "algorithm": args.algorithm,
                       "continual_sample": default, "load_at_start": load_at_start, "load_at_end": os.getloadavg(),
                       "rows": rows}, f, indent=2)


def print_table(rows: list[dict]) -> None:
    print("\n| task | seen test samples | old s | full (null) s | default s | default judged | seen acc old / "
          "default | largest task-row gap |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = r["default"]
        s = d.get("sample")
        judged = f"{s['samples']:,} of {s['of']:,}, {s['per_model']} per model" if s else "all, by every model"
        gap = max(abs(a - b) for a, b in zip(r["old"]["tasks"], d["tasks"], strict=True) if a is not None)
        print(f"| {r['task']} | {r['seen_samples']:,} | {r['old']['eval_s']:.2f} | {r['full']['eval_s']:.2f} | "
              f"{d['eval_s']:.2f} | {judged} | {r['old']['seen_acc']:.4f} / {d['seen_acc']:.4f} | {gap:.4f} |")
    new = [r["default"]["eval_s"] for r in rows]
    mean = float(np.mean(new))
    print(f"\ndefault: {mean:.2f} s per evaluation on average, from {min(new) / mean - 1:+.0%} to "
          f"{max(new) / mean - 1:+.0%} of it; old: {rows[0]['old']['eval_s']:.2f} s at task 1, "
          f"{rows[-1]['old']['eval_s']:.2f} s at task {rows[-1]['task']}")


if __name__ == "__main__":
    main()
