"""Engine speed: fedmosaic's vectorized engine vs its sequential path vs a plain per-client PyTorch loop.

One process, same machine, same partition, same seed and same cohorts for every implementation.

  (a) MNIST, logistic regression, the APFL/FedProx 1000-client power-law partition, E=5, B=10, lr 0.03,
      10 and 100 clients per round, with and without evaluating every client's test split each round;
  (b) CIFAR-10, FedAvg CNN, 100 clients Dirichlet(0.1), 10 per round, E=1, B=50.

The plain loop is written the way most FL libraries train: one nn.Module (a deepcopy of the global model) and one
torch.optim.SGD per client, a DataLoader per client, clients trained one after another, then each client's test
split evaluated one after another. The ceiling is the same model trained as ONE model on big batches of the same
total size (cohort size x B), i.e. what the hardware does when there is no per-client structure at all.

Usage:  FEDMOSAIC_DATA=../shared/data python benchmarks/engine_speed.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from fedmosaic.config import validate
from fedmosaic.data.federated import build
from fedmosaic.engine.federation import Federation, data_spec
from fedmosaic.engine.seeding import sample_cohort


def config(setting: str, per_round: int, evaluate: bool, backend="vectorized", compile=False) -> dict:
    if setting == "a":
        data = {"dataset": "mnist", "clients": None, "partition": {"scheme": "apfl_mnist"}, "pool": "all",
                "client_test": 0.1, "normalize": "pixel"}
        model, train = {"name": "logreg"}, {"local_epochs": 5, "batch_size": 10, "optimizer": {"lr": 0.03}}
    else:
        data = {"dataset": "cifar10", "clients": 100, "partition": {"scheme": "dirichlet", "alpha": 0.1}}
        model, train = {"name": "fedavg_cnn"}, {"local_epochs": 1, "batch_size": 50, "optimizer": {"lr": 0.01}}
    return validate({
        "seed": 0, "data": data, "model": model,
        "train": {**train, "rounds": 1000, "clients_per_round": per_round},
        # (a) is dominated by a few large clients' long runs of tiny steps: fuse 16 steps per compiled call
        "engine": {"backend": backend, "compile": compile, "fuse_steps": 16 if setting == "a" else 1},
        "eval": {"global_test": False, "client_test": evaluate},
    })


def round_samples(fed: Federation, t: int) -> int:
    c = fed.cfg
    cohort = sample_cohort(fed.num_clients, c.train.clients_per_round, c.seed, t)
    return int(fed.split["train"].sizes[cohort].sum()) * c.train.local_epochs


def time_fedmosaic(fed: Federation, rounds: int, warmup: int) -> dict:
    cfg = fed.cfg
    times, samples = [], 0
    for t in range(warmup + rounds):
        t0 = time.perf_counter()
        fed.round(t)
        if cfg.eval.client_test:
            fed.evaluate()
        if t >= warmup:
            times.append(time.perf_counter() - t0)
            samples += round_samples(fed, t)
    return {"s_per_round": float(np.mean(times)), "samples_per_s": samples / sum(times),
            "acc": fed.evaluate().get("global_clients", {}).get("acc")}


class PlainLoop:
    """The usual per-client loop (see module docstring)."""

    def __init__(self, fed: Federation):
        self.fed = fed
        self.model = copy.deepcopy(fed.groups[0].module)
        self.transform = fed.transform
        tr, te = fed.split["train"], fed.split["test"]
        self.train_sets = [TensorDataset(self.transform(tr.x[a:b]), tr.y[a:b]) for a, b in zip(tr.ptr, tr.ptr[1:])]
        self.test_sets = [TensorDataset(self.transform(te.x[a:b]), te.y[a:b]) for a, b in zip(te.ptr, te.ptr[1:])]

    def round(self, t: int, evaluate: bool) -> None:
        c = self.fed.cfg.train
        cohort = sample_cohort(len(self.train_sets), c.clients_per_round, self.fed.cfg.seed, t)
        states, weights = [], []
        for k in cohort:
            local = copy.deepcopy(self.model)
            opt = torch.optim.SGD(local.parameters(), lr=c.optimizer.lr)
            loader = DataLoader(self.train_sets[k], batch_size=c.batch_size, shuffle=True)
            local.train()
            for _ in range(c.local_epochs):
                for x, y in loader:
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(local(x), y).backward()
                    opt.step()
            states.append(local.state_dict())
            weights.append(len(self.train_sets[k]))
        w = torch.tensor(weights, dtype=torch.float32) / sum(weights)
        self.model.load_state_dict({k: sum(wi * s[k] for wi, s in zip(w, states)) for k in states[0]})
        if evaluate:
            self.evaluate()

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        correct = total = 0
        for ds in self.test_sets:
            for x, y in DataLoader(ds, batch_size=64):
                correct += int((self.model(x).argmax(1) == y).sum())
                total += len(y)
        return correct / max(total, 1)


def time_plain(fed: Federation, rounds: int, warmup: int, evaluate: bool) -> dict:
    plain = PlainLoop(fed)
    times, samples = [], 0
    for t in range(warmup + rounds):
        t0 = time.perf_counter()
        plain.round(t, evaluate)
        if t >= warmup:
            times.append(time.perf_counter() - t0)
            samples += round_samples(fed, t)
    return {"s_per_round": float(np.mean(times)), "samples_per_s": samples / sum(times), "acc": plain.evaluate()}


def time_ceiling(fed: Federation, steps: int = 30) -> dict:
    """One model, one optimizer, big batches of cohort x B samples (no per-client structure)."""
    c = fed.cfg.train
    model = copy.deepcopy(fed.groups[0].module)
    opt = torch.optim.SGD(model.parameters(), lr=c.optimizer.lr)
    tr = fed.split["train"]
    bs = c.clients_per_round * c.batch_size
    g = torch.Generator().manual_seed(0)
    for i in range(steps + 3):
        if i == 3:
            t0 = time.perf_counter()
        idx = torch.randint(len(tr.y), (bs,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(fed.transform(tr.x[idx])), tr.y[idx]).backward()
        opt.step()
    return {"samples_per_s": steps * bs / (time.perf_counter() - t0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run, not for the table)")
    ap.add_argument("--json", help="write the raw numbers here")
    ap.add_argument("--only", choices=("a", "b"))
    ap.add_argument("--compile-b", action="store_true", help="also torch.compile the CNN (minutes of compiling)")
    args = ap.parse_args()
    R = 3 if args.quick else 20
    rows = []
    settings = [("a", 10, True), ("a", 10, False), ("a", 100, True), ("a", 100, False), ("b", 10, False)]
    fds = {}
    for setting, m, ev in settings:
        if args.only and setting != args.only:
            continue
        base = config(setting, m, ev)
        fd = fds.setdefault(setting, build(data_spec(base)))
        rounds = {"a": R if m == 10 else max(3, R // 2), "b": 2 if args.quick else 3}[setting]
        label = f"({setting}) {base.data.dataset} {base.model.name}, {m}/round, " + ("eval every round" if ev else "train only")
        res = {"setting": label}
        fed = Federation(base, fd)
        res["plain"] = time_plain(fed, rounds, 1, ev)
        res["sequential"] = time_fedmosaic(Federation(config(setting, m, ev, "sequential"), fd), rounds, 1)
        res["vectorized"] = time_fedmosaic(Federation(base, fd), rounds, 1)
        if setting == "a" or args.compile_b:
            t0 = time.perf_counter()
            comp = Federation(config(setting, m, ev, compile=True), fd)
            # compile once for the cohort shapes a run meets (at most ~8 power-of-two buckets, plain and fused);
            # this one-time cost is reported separately as compile_warmup_s
            for t in range(30 if setting == "a" else 3):
                comp.round(1000 + t)
            res["compile_warmup_s"] = time.perf_counter() - t0
            res["vectorized+compile"] = time_fedmosaic(comp, rounds, 1)
        res["ceiling"] = time_ceiling(fed)
        res["rounds_timed"] = rounds
        rows.append(res)
        print(json.dumps(res), flush=True)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.platform(), "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


def print_table(rows) -> None:
    impls = ("plain", "sequential", "vectorized", "vectorized+compile")
    print("\n| setting | " + " | ".join(f"{i} s/round" for i in impls) +
          " | speed-up vs plain (vectorized / +compile) | best samples/s | ceiling samples/s |")
    print("|---" * (len(impls) + 4) + "|")
    for r in rows:
        done = [i for i in impls if i in r]
        best = max(r[i]["samples_per_s"] for i in done if i.startswith("vectorized"))
        cells = [f"{r[i]['s_per_round']:.3f}" if i in r else "n/a" for i in impls]
        sp = " / ".join(f"{r['plain']['s_per_round'] / r[i]['s_per_round']:.1f}x" for i in done
                        if i.startswith("vectorized"))
        print(f"| {r['setting']} | " + " | ".join(cells) + f" | {sp} | {best:,.0f} | "
              f"{r['ceiling']['samples_per_s']:,.0f} ({best / r['ceiling']['samples_per_s']:.0%}) |")


if __name__ == "__main__":
    main()
