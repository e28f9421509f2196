"""Golden numbers for refactoring the round engine: a few rounds of one algorithm per family and engine mechanism,
each on both backends, reduced to their metrics (timings left out) and a SHA-256 of every tensor of the final state
(server, client stores, BatchNorm buffers, exemplar memory). A refactor that must not change numbers runs
``--check`` before and after each step: any difference is named (algorithm, backend, metric or tensor).

Goldens are specific to the machine and the torch build (float sums differ across CPUs), so they are written
to a file of your choice, not committed:

    OMP_NUM_THREADS=1 python benchmarks/protocol_golden.py --write /tmp/golden.json     # before
    OMP_NUM_THREADS=1 python benchmarks/protocol_golden.py --check /tmp/golden.json     # after each step
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
from pathlib import Path

import torch

from fedmosaic.config import validate
from fedmosaic.protocol.codec import tensor_bytes
from fedmosaic.protocol.tree import leaves
from fedmosaic.setup.world import build_federation

BASE = {
    "seed": 11,
    "data": {"dataset": "digits", "clients": 6, "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_size": 5},
             "client_test": 0.25},
    "model": {"name": "mlp", "options": {"hidden": 8}},
    "train": {"rounds": 3, "clients_per_round": 3, "local_epochs": 1, "batch_size": 8, "optimizer": {"lr": 0.05}},
    "engine": {"threads": 1},
}
PUBLIC = {"data": {"public": {"source": "noise", "size": 16}}}
HETERO = {"data": {"public": {"source": "noise", "size": 16}},
          "model": {"heterogeneous": [{"name": "mlp", "options": {"hidden": 8}},
                                      {"name": "mlp", "options": {"hidden": [12, 12]}}]},
          "train": {"warmup_epochs": 1, "optimizer": {"name": "adam", "lr": 0.01}}, "eval": {"cross_clients": True}}
CONTINUAL = {"data": {"dataset": "digits", "clients": 4, "partition": {"scheme": "iid"}, "client_test": 0.0,
                      "tasks": {"n_tasks": 5, "rounds_per_task": 1, "memory": {"per_class": 2}}},
             "eval": {"client_test": False}}
BATCHNORM = {"model": {"name": "resnet10", "options": {"norm": "batch", "width": 0.125}}}
BACKENDS = ("sequential", "vectorized")


def merged(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        nested = isinstance(v, dict) and isinstance(out.get(k), dict) and k not in ("partition", "model")
        out[k] = merged(out[k], v) if nested else copy.deepcopy(v)
    return out


CASES = {
    "fedavg": ({"name": "fedavg"}, {}), "scaffold": ({"name": "scaffold"}, {}), "fedcurv": ({"name": "fedcurv"}, {}),
    "ditto": ({"name": "ditto"}, {}), "apfl_pd": ({"name": "apfl_pd", "z": 1}, {}), "pfedsrb": ({"name": "pfedsrb"}, {}),
    "fedpac": ({"name": "fedpac"}, {}), "fedkd": ({"name": "fedkd"}, {}), "fedproto": ({"name": "fedproto"}, {}),
    "ahf": ({"name": "ahf"}, HETERO), "fccl": ({"name": "fccl"}, HETERO), "fedmd": ({"name": "fedmd"}, HETERO),
    "rhfl": ({"name": "rhfl"}, HETERO), "feddf_global": ({"name": "feddf_global"}, PUBLIC),
    "protofcl": ({"name": "protofcl"}, CONTINUAL), "fedweit": ({"name": "fedweit"}, CONTINUAL),
    "glfc": ({"name": "glfc"}, CONTINUAL), "fedlwf": ({"name": "fedlwf"}, CONTINUAL),
    "fedewc": ({"name": "fedewc"}, CONTINUAL), "cfed": ({"name": "cfed"}, merged(CONTINUAL, PUBLIC)),
    "protofcl_global": ({"name": "protofcl", "prototypes": "global"}, CONTINUAL),
    "fedsi": ({"name": "fedsi"}, CONTINUAL), "fedpmr": ({"name": "fedpmr"}, CONTINUAL),
    "fedrecon": ({"name": "fedrecon", "encoder": "initial"}, CONTINUAL),
    "fedavg_batchnorm": ({"name": "fedavg"}, BATCHNORM),
}


def digest(tree) -> list[str]:
    """Per tensor (in tree order) its dtype, shape and the SHA-256 of its bytes."""
    return [f"{t.dtype} {list(t.shape)} {hashlib.sha256(tensor_bytes(t)).hexdigest()[:16]}" for t in leaves(tree)]


def golden(name: str, backend: str) -> dict:
    algo, over = CASES[name]
    raw = merged(BASE, over) | {"algorithm": algo}
    raw["engine"] = {**raw.get("engine", {}), "backend": backend}
    cfg = validate(raw)
    fed = build_federation(cfg)
    records = []
    for t in range(cfg.train.rounds):
        rec = fed.round(t)
        rec.update(fed.evaluate(t))
        records.append({k: v for k, v in rec.items() if not k.startswith("time")})
    return {"records": json.loads(json.dumps(records, default=str)), "state": digest(fed.state_dict())}


def differences(want: dict, got: dict, where: str) -> list[str]:
    if isinstance(want, dict) and isinstance(got, dict):
        return [d for k in sorted(set(want) | set(got), key=str)
                for d in differences(want.get(k), got.get(k), f"{where}.{k}")]
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (a, b) in enumerate(zip(want, got, strict=True)) for d in differences(a, b, f"{where}[{i}]")]
    return [] if want == got else [f"{where}: {str(want)[:60]} -> {str(got)[:60]}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path)
    mode.add_argument("--check", type=Path)
    ap.add_argument("--only", nargs="*", choices=sorted(CASES), help="default: every case")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = args.only or list(CASES)
    got = {f"{n}/{b}": golden(n, b) for n in names for b in BACKENDS}
    if args.write:
        args.write.write_text(json.dumps(got, indent=1))
        print(f"wrote {len(got)} goldens to {args.write}")
        return 0
    want = json.loads(args.check.read_text())
    bad = [d for key in got for d in differences(want.get(key), got[key], key)]
    for line in bad[:50]:
        print(line)
    print(f"{len(got) - len({b.split('.')[0].split('[')[0] for b in bad})} of {len(got)} identical"
          + (f"; {len(bad)} differences" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
