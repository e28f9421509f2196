"""Engine speed: fedmosaic's executions (the default ``auto``, and each forced) vs a plain per-client PyTorch loop.

One process, same machine, same partition, same seed and same cohorts for every implementation.

  (a) MNIST, logistic regression, the APFL/FedProx 1000-client power-law partition, E=5, B=10, lr 0.03,
      10 and 100 clients per round, with and without evaluating every client's test split each round;
  (b) CIFAR-10, FedAvg CNN, 100 clients Dirichlet(0.1), 10 per round, E=1, B=50;
  (e2e) a whole run, start to finish: FedAvg on the APFL MNIST preset (150 rounds, 10 clients per round, every
      client's test split evaluated after every round), as ``fedmosaic run`` does it (data, rounds, evaluation,
      metrics, checkpoints, summary; any compile warm-up included), against the plain loop doing the same run
      from the same cached partition, and against Flower 1.42's simulation of it (``flower_sim.py``). Each run is
      its own process (interpreter and imports counted for all).

The plain loop is written the way most FL libraries train: one nn.Module (a deepcopy of the global model) and one
torch.optim.SGD per client, a DataLoader per client, clients trained one after another, then each client's test
split evaluated one after another. The ceiling is the same model trained as ONE model on big batches of the same
total size (cohort size x B), i.e. what the hardware does when there is no per-client structure at all.

Usage:  FEDMOSAIC_DATA=../shared/data python benchmarks/engine_speed.py [--quick] [--only a|b|e2e|precision] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from fedmosaic.config import load_config, validate
from fedmosaic.data.federated import build
from fedmosaic.engine.client.transforms import make_normalizer
from fedmosaic.engine.federation import Federation
from fedmosaic.engine.seeding import sample_cohort
from fedmosaic.models import build_model
from fedmosaic.setup.groups import data_spec
from fedmosaic.setup.world import build_federation

#: The end-to-end run: the APFL MNIST preset with FedAvg alone.
E2E_PRESET = "apfl-mnist"
E2E_SET = ["algorithm={name: fedavg}", "compare=null"]


def config(setting: str, per_round: int, evaluate: bool, backend="auto", compile="auto", global_test=False,
           model_name: str | None = None, **engine) -> dict:
    if setting == "a":
        data = {"dataset": "mnist", "clients": None, "partition": {"scheme": "apfl_mnist"}, "pool": "all",
                "client_test": 0.1, "normalize": "pixel"}
        model, train = {"name": "logreg"}, {"local_epochs": 5, "batch_size": 10, "optimizer": {"lr": 0.03}}
    else:
        data = {"dataset": "cifar10", "clients": 100, "partition": {"scheme": "dirichlet", "alpha": 0.1}}
        model, train = {"name": model_name or "fedavg_cnn"}, {"local_epochs": 1, "batch_size": 50, "optimizer": {"lr": 0.01}}
    return validate({
        # rounds: what ``auto`` plans for (the papers' 150 for (a)); the timed rounds are fewer
        "seed": 0, "data": data, "model": model,
        "train": {**train, "rounds": 150 if setting == "a" else 100, "clients_per_round": per_round},
        # (a) is dominated by a few large clients' long runs of tiny steps: fuse 16 steps per compiled call
        "engine": {"backend": backend, "compile": compile, "fuse_steps": 16 if setting == "a" else 1, **engine},
        "eval": {"global_test": global_test, "client_test": evaluate},
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
    def accuracy(self, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> float:
        self.model.eval()
        hits = sum(int((self.model(self.transform(x[i : i + batch])).argmax(1) == y[i : i + batch]).sum())
                   for i in range(0, len(y), batch))
        self.model.train()
        return hits / len(y)

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
        x = fed.transform(tr.x[idx])
        if x.dim() == 4:  # images in the CPU convolutions' fastest memory order (as fedmosaic's default feeds them)
            x = x.contiguous(memory_format=torch.channels_last)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), tr.y[idx]).backward()
        opt.step()
    return {"samples_per_s": steps * bs / (time.perf_counter() - t0)}


# ---- precision: (b)'s CIFAR CNN trained for the same rounds in each precision ---------------------------------
#: (name, engine settings) of the precision rows; on CUDA also TF32, fp16 (loss-scaled) and the compiled steps
PRECISIONS = [("fp32", {}), ("bf16", {"precision": "bf16"})]
CUDA_PRECISIONS = [("tf32", {"tf32": True}), ("fp16", {"precision": "fp16"}),
                   ("fp32 compiled", {"backend": "vectorized", "compile": True}),
                   ("bf16 compiled", {"backend": "vectorized", "compile": True, "precision": "bf16"})]


def time_precisions(rounds: int, device: str, model: str = "fedavg_cnn", only: list | None = None) -> dict:
    """(b)'s setting (CIFAR-10, FedAvg CNN, 100 clients Dir(0.1), 10 per round, E = 1, B = 50) trained for
    ``rounds`` rounds from the same initial model, cohorts and batches by the plain loop (float32) and by
    fedmosaic's default execution in each precision: seconds per round (the first round, with any compiling, not
    counted) and accuracy on the global test set after the last round. ``only``: these rows (and the plain loop's)."""
    fd = build(data_spec(config("b", 10, False)))
    rows = {}
    variants = PRECISIONS + (CUDA_PRECISIONS if device.startswith("cuda") else [])
    if only:
        unknown = set(only) - {n for n, _ in variants}
        if unknown:
            raise SystemExit(f"--precision-rows: no row {sorted(unknown)} on {device} (rows: "
                             f"{', '.join(n for n, _ in variants)})")
        variants = [v for v in variants if v[0] in only]
    for name, engine in [("plain", {}), *variants]:
        fed = build_federation(config("b", 10, False, global_test=True, model_name=model, device=device, **engine), fd)
        plain = PlainLoop(fed) if name == "plain" else None
        times = []
        for t in range(rounds):
            t0 = time.perf_counter()
            plain.round(t, False) if plain else fed.round(t)
            if fed.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        acc = plain.accuracy(*fed.global_test) if plain else fed.evaluate()["global"]["acc"]
        rows[name] = {"s_per_round": float(np.mean(times[1:])), "first_round_s": times[0], "acc": acc,
                      "execution": "plain loop" if plain else fed.execution}
        print(json.dumps({name: rows[name]}), flush=True)
    return {"rounds": rounds, "model": model, "device": str(fed.device), "gpu": torch.cuda.get_device_name(fed.device)
            if fed.device.type == "cuda" else None, "rows": rows}


def print_precisions(res: dict) -> None:
    print(f"\n| {res['model']}, {res['device']}, {res['rounds']} rounds | s/round | vs plain | accuracy | execution |")
    print("|---|---|---|---|---|")
    plain = res["rows"]["plain"]
    for name, r in res["rows"].items():
        print(f"| {name} | {r['s_per_round']:.3f} | {plain['s_per_round'] / r['s_per_round']:.2f}x | "
              f"{r['acc']:.4f} ({100 * (r['acc'] - plain['acc']):+.2f} pp) | {r['execution']} |")


# ---- end to end ----------------------------------------------------------------------------------------------
def e2e_config(rounds: int):
    from fedmosaic.presets import preset_path

    return load_config(preset_path(E2E_PRESET), [*E2E_SET, f"train.rounds={rounds}"])


def e2e_data(rounds: int):
    """The end-to-end run's config and its clients' train and test splits as TensorDatasets (the cached partition,
    the preset's normalisation): what the plain loop and the Flower simulation (``flower_sim.py``) train on."""
    cfg = e2e_config(rounds)
    fd = build(data_spec(cfg))
    norm = make_normalizer(cfg.data.normalize, fd.x["train"], "cpu")

    def ds(split, a, b):
        return TensorDataset(norm(torch.as_tensor(fd.x[split][a:b])), torch.as_tensor(fd.y[split][a:b]))

    train_sets = [ds("train", a, b) for a, b in zip(fd.ptr["train"], fd.ptr["train"][1:])]
    test_sets = [ds("test", a, b) for a, b in zip(fd.ptr["test"], fd.ptr["test"][1:])]
    return cfg, fd, train_sets, test_sets


def plain_train(model: torch.nn.Module, data: TensorDataset, c) -> dict:
    """One client's local training as most FL code writes it: SGD, a shuffling DataLoader, ``c.local_epochs``."""
    opt = torch.optim.SGD(model.parameters(), lr=c.optimizer.lr)
    model.train()
    for _ in range(c.local_epochs):
        for x, y in DataLoader(data, batch_size=c.batch_size, shuffle=True):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return model.state_dict()


def plain_accuracy(model: torch.nn.Module, test_sets: list) -> float:
    """Accuracy over every client's test split (one after another), i.e. on their union."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for d in test_sets:
            for x, y in DataLoader(d, batch_size=64):
                correct += int((model(x).argmax(1) == y).sum())
                total += len(y)
    return correct / max(total, 1)


def plain_run(rounds: int) -> dict:
    """The whole run with the plain loop, in this process: the same cached partition, the preset's normalisation,
    model, optimiser, cohorts and per-round evaluation of every client's test split (timed by the parent)."""
    cfg, fd, train_sets, test_sets = e2e_data(rounds)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model.name, fd.dataset.input_shape, fd.num_classes)
    c = cfg.train
    accs = []
    for t in range(c.rounds):
        cohort = sample_cohort(len(train_sets), c.clients_per_round, cfg.seed, t)
        states = [plain_train(copy.deepcopy(model), train_sets[k], c) for k in cohort]
        weights = [len(train_sets[k]) for k in cohort]
        w = torch.tensor(weights, dtype=torch.float32) / sum(weights)
        model.load_state_dict({k: sum(wi * s[k] for wi, s in zip(w, states)) for k in states[0]})
        accs.append(plain_accuracy(model, test_sets))
    return {"acc_final": accs[-1], "acc_mean": float(np.mean(accs))}


def timed_process(argv: list[str], env: dict | None = None) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=False)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr[-2000:]}")
    return wall, done.stdout


def e2e_once(rounds: int, name: str, sets: list[str], env: dict | None = None) -> dict:
    """One fresh process, timed from start to finish: the plain loop (``name == "plain"``), Flower's simulation of
    the same run (``"flower"``: ``flower_sim.py``) or ``fedmosaic run``
    with ``sets`` (compiling variants get an empty inductor cache: a cold start); ``env``: e.g. a PYTHONPATH
    that runs another commit's fedmosaic (``--against``)."""
    if name in ("plain", "flower"):
        argv = [__file__, "--plain-run", str(rounds)] if name == "plain" else \
            [str(Path(__file__).with_name("flower_sim.py")), "--rounds", str(rounds)]
        wall, out = timed_process([sys.executable, *argv])
        return {"wall_s": wall, **json.loads(out.strip().splitlines()[-1])}
    exe = Path(sys.executable).with_name("fedmosaic")
    with tempfile.TemporaryDirectory() as tmp:
        argv = [str(exe), "run", E2E_PRESET, "--no-progress", "--out", f"{tmp}/run"]
        for item in [*E2E_SET, f"train.rounds={rounds}", *sets]:
            argv += ["--set", item]
        wall, out = timed_process(argv, {"TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor", **(env or {})})
        summary = json.loads(Path(f"{tmp}/run/summary.json").read_text())
        line = next((ln for ln in out.splitlines() if ln.startswith("fedmosaic: execution: ")), "")
    return {"wall_s": wall, "acc_final": summary.get("global_clients_acc_final"),
            "acc_mean": summary.get("global_clients_acc_mean"), "rounds_wall_s": summary.get("wall_time_s"),
            "execution": line.removeprefix("fedmosaic: execution: ")}


def time_end_to_end(rounds: int, variants: list[tuple], repeat: int = 1) -> dict:
    """Wall-clock seconds of the whole run, each in a fresh process: the plain loop and each variant (the default
    first), ``repeat`` times in alternation (plain, variants, plain, variants, ...) so that the machine's drifts
    hit all alike, the variants' order rotated at each repeat (the run right after the plain loop's is measurably
    slower on this VM: each variant takes each place alike); each entry keeps every wall time and their median,
    and the speed-up is of the medians."""
    res = {"rounds": rounds, "repeat": repeat}
    build(data_spec(e2e_config(rounds)))  # the partition cache all read (made once, outside the timings)
    for i in range(repeat):
        turn = variants[i % len(variants):] + variants[: i % len(variants)] if variants else []
        for name, sets, *env in [("plain", []), *turn]:
            r = e2e_once(rounds, name, sets, *env)
            entry = res.setdefault(name, {**r, "walls_s": []})
            entry["walls_s"].append(r["wall_s"])
            entry["wall_s"] = float(np.median(entry["walls_s"]))
            print(json.dumps({name: r}), flush=True)
    for name, *_ in variants:
        res[name]["speedup_vs_plain"] = res["plain"]["wall_s"] / res[name]["wall_s"]
    return res


def against(rev: str) -> tuple[str, list[str], dict]:
    """The default variant run by commit ``rev``'s fedmosaic: a git worktree of it, first on PYTHONPATH."""
    root = Path(__file__).resolve().parents[1]
    sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    tree = Path(tempfile.gettempdir()) / f"fedmosaic-{sha}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(tree), sha], check=True,
                       capture_output=True)
    return f"default@{sha}", [], {"PYTHONPATH": str(tree / "src")}


E2E_VARIANTS = [
    ("default", []),
    ("vectorized", ["engine.backend=vectorized", "engine.compile=false"]),
    ("vectorized+compile", ["engine.backend=vectorized", "engine.compile=true", "engine.fuse_steps=16"]),
    ("sequential", ["engine.backend=sequential"]),
    ("flower", []),  # Flower 1.42's simulation of the same run (flower_sim.py; the flower extra)
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run, not for the table)")
    ap.add_argument("--json", help="write the raw numbers here")
    ap.add_argument("--only", choices=("a", "b", "e2e", "precision"))
    ap.add_argument("--precision-rounds", type=int, default=50, help="rounds each precision trains (--only precision)")
    ap.add_argument("--device", default="cpu", help="the precision rows' device (cpu, cuda)")
    ap.add_argument("--model", default="fedavg_cnn", help="the precision rows' model (e.g. resnet10, resnet18)")
    ap.add_argument("--precision-rows", help="comma-separated subset of the precision rows (the plain loop always runs)")
    ap.add_argument("--compile-b", action="store_true", help="also torch.compile the CNN (minutes of compiling)")
    ap.add_argument("--e2e-rounds", type=int, default=150)
    ap.add_argument("--e2e-repeat", type=int, default=1, help="alternate plain and variants this many times")
    ap.add_argument("--e2e-variants", help="comma-separated subset of: " + ", ".join(n for n, _ in E2E_VARIANTS))
    ap.add_argument("--against", help="also time the default as run by this git revision (e.g. HEAD~1)")
    ap.add_argument("--plain-run", type=int, help=argparse.SUPPRESS)  # the child process of the end-to-end row
    args = ap.parse_args()
    load_at_start = os.getloadavg()
    if args.plain_run:
        print(json.dumps(plain_run(args.plain_run)))
        return
    if args.only == "precision":
        only = args.precision_rows.split(",") if args.precision_rows else None
        res = time_precisions(args.precision_rounds, args.device, args.model, only)
        print_precisions(res)
        if args.json:
            write_json(args.json, load_at_start, **res)
        return
    R = 3 if args.quick else 20
    rows = []
    settings = [("a", 10, True), ("a", 10, False), ("a", 100, True), ("a", 100, False), ("b", 10, False)]
    fds = {}
    e2e = None
    if args.only in (None, "e2e"):
        keep = args.e2e_variants.split(",") if args.e2e_variants else [n for n, _ in E2E_VARIANTS]
        variants = [v for v in E2E_VARIANTS if v[0] in keep] + ([against(args.against)] if args.against else [])
        e2e = time_end_to_end(args.e2e_rounds, variants, args.e2e_repeat)
        print_e2e(e2e)
    for setting, m, ev in settings:
        if args.only and setting != args.only:
            continue
        base = config(setting, m, ev)
        fd = fds.setdefault(setting, build(data_spec(base)))
        rounds = {"a": R if m == 10 else max(3, R // 2), "b": 2 if args.quick else 3}[setting]
        label = f"({setting}) {base.data.dataset} {base.model.name}, {m}/round, " + ("eval every round" if ev else "train only")
        res = {"setting": label}
        fed = build_federation(base, fd)
        res["execution"] = fed.execution
        res["plain"] = time_plain(fed, rounds, 1, ev)
        res["default"] = time_fedmosaic(fed, rounds, 1)
        res["sequential"] = time_fedmosaic(build_federation(config(setting, m, ev, "sequential", False), fd), rounds, 1)
        res["vectorized"] = time_fedmosaic(build_federation(config(setting, m, ev, "vectorized", False), fd), rounds, 1)
        if setting == "a" or args.compile_b:
            t0 = time.perf_counter()
            comp = build_federation(config(setting, m, ev, "vectorized", compile=True), fd)
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
    if rows:
        print_table(rows)
    if args.json:
        write_json(args.json, load_at_start, rows=rows, end_to_end=e2e)


def write_json(path: str, load_at_start, **results) -> None:
    """The raw numbers with the machine, software and load they were measured under."""
    with open(path, "w") as f:
        json.dump({"machine": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count(),
                   "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M"),
                   "load_at_start": load_at_start, "load_at_end": os.getloadavg(), **results}, f, indent=2)


def print_e2e(e2e: dict) -> None:
    print(f"\n| whole run ({e2e['rounds']} rounds) | median wall s | each run | vs plain | final acc | execution |")
    print("|---|---|---|---|---|---|")
    for name, r in e2e.items():
        if isinstance(r, dict):
            sp = f"{e2e['plain']['wall_s'] / r['wall_s']:.2f}x"
            each = ", ".join(f"{w:.1f}" for w in r["walls_s"])
            print(f"| {name} | {r['wall_s']:.1f} | {each} | {sp} | {r['acc_final']:.4f} | {r.get('execution', '')} |")


def print_table(rows) -> None:
    impls = ("plain", "default", "sequential", "vectorized", "vectorized+compile")
    print("\n| setting | " + " | ".join(f"{i} s/round" for i in impls) +
          " | speed-up vs plain (default / vectorized / +compile) | best samples/s | ceiling samples/s |")
    print("|---" * (len(impls) + 4) + "|")
    for r in rows:
        done = [i for i in impls if i in r]
        best = max(r[i]["samples_per_s"] for i in done if i != "plain")
        cells = [f"{r[i]['s_per_round']:.3f}" if i in r else "n/a" for i in impls]
        sp = " / ".join(f"{r['plain']['s_per_round'] / r[i]['s_per_round']:.2f}x" for i in done
                        if i in ("default", "vectorized", "vectorized+compile"))
        print(f"| {r['setting']} | " + " | ".join(cells) + f" | {sp} | {best:,.0f} | "
              f"{r['ceiling']['samples_per_s']:,.0f} ({best / r['ceiling']['samples_per_s']:.0%}) |")


if __name__ == "__main__":
    main()
