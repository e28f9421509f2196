"""How long one method of a preset (its `algorithm:`) takes on this machine, on one CPU thread: the runtime
`fedmosaic list presets` shows (each preset's `# runtime:` comment line), beside the number of methods its
`compare:` lists (`fedmosaic run PRESET` runs them all, each its own time).

A preset whose round is cheap runs for real, in full when the whole run fits in ``--measure-up-to`` seconds
("measured"), else for as many rounds as fit in ``--budget`` seconds, and the rest is extrapolated from their mean
round ("~", estimated). A preset whose round alone would take longer than ``--budget`` is estimated from timed
steps of its own models: (forward + backward + update of one batch) x the client steps its rounds take (the
engine's own step count, public-data phases included), plus a forward pass per test prediction x the predictions
of its evaluations; an algorithm's extra passes (a teacher's forward) are not counted, so these are lower bounds.

A preset whose dataset is not on the data path (no internet here) is timed on random images of the dataset's
shape and sizes (a stand-in: the same model, client count, steps and test predictions; the accuracy is
meaningless, only time is taken).

    OMP_NUM_THREADS=1 FEDMOSAIC_DATA=../shared/data python benchmarks/preset_runtime.py --json out.json [--write]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedmosaic.config import load_config, validate
from fedmosaic.data.registry import find_layout, get_spec, register_dataset
from fedmosaic.engine.federation import Federation
from fedmosaic.presets import preset_names, preset_path
from fedmosaic.runs.records import read_metrics
from fedmosaic.runs.runner import run
from fedmosaic.setup.world import build_federation

#: datasets that are not offline here: (train, test, shape, classes) of the real one, and how its clients split it
#: (a per-domain split becomes an even split of the same totals; per domain its test set is its client's)
STAND_INS = {
    "cinic10": ((90_000,), (90_000,), (3, 32, 32), 10),
    "office-caltech10-images": ((766, 898, 125, 236), (192, 225, 32, 59), (3, 32, 32), 10),
    "digits-domains": ((150, 100, 5000, 2000), (10_000, 2007, 26_032, 9000), (3, 32, 32), 10),
}


def stand_in(cfg):
    """``cfg`` on random images of its dataset's shape and sizes (see STAND_INS)."""
    train, test, shape, classes = STAND_INS[cfg.data.dataset]
    rng = np.random.default_rng(0)
    name = f"{cfg.data.dataset}-standin"

    def images(n):
        return rng.integers(0, 256, (n, *shape), dtype=np.uint8), rng.integers(0, classes, n)

    data = {"dataset": name}
    if len(train) > 1:  # per domain: pooled, an even split into as many clients, each its share of the tests
        (xs, ys), n_test = images(sum(train) + sum(test)), sum(test)
        register_dataset(name, xs, ys, classes=classes)
        data |= {"clients": len(train), "partition": {"scheme": "iid"},
                 "client_test": n_test / (sum(train) + n_test)}
    else:
        register_dataset(name, *images(train[0]), *images(test[0]), classes=classes)
    raw = cfg.model_dump(mode="json")
    return validate(raw | {"data": raw["data"] | data})


def step_seconds(module: torch.nn.Module, shape: tuple, batch: int, classes: int, repeat: int = 3) -> float:
    """One SGD step (forward, backward, update) of ``module`` on a random batch, best of ``repeat`` after a warm-up."""
    x, y = torch.randn(batch, *shape), torch.randint(0, classes, (batch,))
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    module.train()
    best = math.inf
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        out = module(x)
        F.cross_entropy(out[-1] if isinstance(out, tuple) else out, y).backward()
        opt.step()
        opt.zero_grad()
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def forward_seconds_per_sample(module: torch.nn.Module, shape: tuple, batch: int = 256, repeat: int = 3) -> float:
    """An evaluation forward pass per sample, best of ``repeat`` batches after a warm-up."""
    module.eval()
    x = torch.randn(batch, *shape)
    module(x)
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        module(x)
        best = min(best, time.perf_counter() - t0)
    return best / batch


def from_steps(fed: Federation) -> tuple[float, float, str]:
    """(seconds a round trains, seconds an evaluation takes, how) from timed steps of each group's model."""
    cfg, shape, C = fed.cfg, fed.fd.dataset.input_shape, fed.fd.num_classes
    train = evaluate = 0.0
    tests = int(fed.split["test"].sizes.sum())
    steps = 0.0
    for g in fed.groups:
        facts = fed.run_facts(g)
        steps += facts.client_steps
        train += facts.client_steps * step_seconds(g.module, shape, facts.batch, C)
        # with eval.cross_clients every client's model on every client's test split, else (eval.client_test) each
        # on its own
        predictions = (tests * len(g.clients) if cfg.eval.cross_clients
                       else tests * len(g.clients) / fed.num_clients if cfg.eval.client_test else 0.0)
        if cfg.eval.global_test and fed.global_test is not None:
            predictions += len(fed.global_test[1]) * (1 if fed.algo.global_model else len(g.clients))
        evaluate += predictions * forward_seconds_per_sample(g.module, shape)
    return train, evaluate, f"timed steps of its models x {steps:,.0f} client steps a round"


def runtime(name: str, budget: float, measure_up_to: float) -> dict:
    cfg = load_config(preset_path(name), ["engine.threads=1"])
    standin = find_layout(get_spec(cfg.data.dataset)) is None
    if standin:
        cfg = stand_in(cfg)
    t0 = time.perf_counter()
    fed = build_federation(cfg)
    setup = time.perf_counter() - t0
    rounds, every = cfg.train.rounds, cfg.eval.every
    train, evaluate, how = from_steps(fed)
    per_round = train + evaluate / every
    result = {"preset": name, "rounds": rounds, "setup_s": setup, "stand_in": standin,
              "step_estimate_round_s": per_round}
    if per_round > budget:
        result |= {"seconds": setup + rounds * per_round, "measured": False, "how": how}
        return result
    with tempfile.TemporaryDirectory() as tmp:
        whole = setup + rounds * per_round < measure_up_to
        stop = rounds if whole else max(2, min(rounds, int(budget / max(per_round, 1e-3))))
        t0 = time.perf_counter()
        run(cfg, Path(tmp) / "r", progress=False, stop_after=stop, fd=fed.fd)
        wall = time.perf_counter() - t0
        recs = read_metrics(Path(tmp) / "r")
    done = len(recs)
    if done >= rounds:
        result |= {"seconds": wall, "measured": True, "how": "the whole run"}
    else:
        rest = np.mean([r.get("time_round_s", 0) + r.get("time_eval_s", 0) for r in recs[1:]] or [wall / done])
        result |= {"seconds": wall + (rounds - done) * float(rest), "measured": False,
                   "how": f"{done} of {rounds} rounds timed"}
    return result


def shown(seconds: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size if unit == "days" else seconds >= size:
            value = seconds / size
            return f"{value:.0f} {unit}" if value >= 10 else f"{value:.1f} {unit}"
    return f"{max(seconds, 1):.0f} s"


def comment(r: dict) -> str:
    how = r["how"] + (", on a stand-in of the dataset's shape and sizes" if r["stand_in"] else "")
    if r["measured"]:
        return f"# runtime: {shown(r['seconds'])} (measured: {how}, one thread of a 2-core CPU)"
    return f"# runtime: ~{shown(r['seconds'])} (estimated: {how}, one thread of a 2-core CPU)"


def write(name: str, line: str) -> None:
    """Put ``line`` as the preset's `# runtime:` comment (replacing the old one; else after the first line)."""
    path = preset_path(name)
    lines = path.read_text().splitlines()
    lines = [ln for ln in lines if not ln.startswith("# runtime: ")]
    lines.insert(1, line)
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("presets", nargs="*", help="default: every preset")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds of real rounds per preset")
    ap.add_argument("--measure-up-to", type=float, default=180.0, help="run the whole preset when it fits")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--write", action="store_true", help="update the presets' `# runtime:` lines")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    for name in args.presets or preset_names():
        r = runtime(name, args.budget, args.measure_up_to)
        results.append(r)
        print(f"{name:28s} {comment(r)}", flush=True)
        if args.write:
            write(name, comment(r))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
