"""The end-to-end run of ``engine_speed.py`` (FedAvg on the APFL MNIST preset: 1000 power-law clients, 10 a round,
E = 5, B = 10, lr 0.03, 150 rounds, the global model evaluated on every client's test split after every round) as a
Flower 1.42 simulation: a ServerApp running Flower's own FedAvg strategy (its cohort sampling, its weighted mean)
and a ClientApp training the plain loop's way (``plain_train``) on the same cached partition, on Flower's Ray
backend with one CPU per client (two clients at a time on two cores). Evaluation is centralised (``evaluate_fn``)
over the union of the clients' test splits, i.e. fedmosaic's ``global_clients_acc``; no client-side evaluation.

  FEDMOSAIC_DATA=../shared/data python benchmarks/flower_sim.py [--rounds 150]   # prints one JSON line at the end

``python benchmarks/engine_speed.py --only e2e --e2e-variants default,flower --e2e-repeat 3`` times it beside the
plain loop and fedmosaic's default, each a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_speed import e2e_data, plain_accuracy, plain_train  # noqa: E402

from fedmosaic.models import build_model  # noqa: E402

ROUNDS = int(os.environ.get("FLOWER_SIM_ROUNDS", "150"))
_DATA: tuple | None = None  # per process (the driver and each Ray actor): the partition, loaded once


def data() -> tuple:
    global _DATA
    if _DATA is None:
        torch.set_num_threads(1)
        _DATA = e2e_data(ROUNDS)
    return _DATA


def new_model() -> torch.nn.Module:
    cfg, fd, *_ = data()
    return build_model(cfg.model.name, fd.dataset.input_shape, fd.num_classes)


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    cfg, _, train_sets, _ = data()
    k = int(context.node_config["partition-id"])
    model = new_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    state = plain_train(model, train_sets[k], cfg.train)
    reply = RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord({"num-examples": len(train_sets[k])})})
    return Message(content=reply, reply_to=msg)


server = ServerApp()
RESULT: dict = {}


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg, _, train_sets, test_sets = data()
    torch.manual_seed(cfg.seed)  # the initial model, as the plain loop's (a client only loads weights into its own)
    model = new_model()
    accs = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        acc = plain_accuracy(model, test_sets)
        if server_round:  # round 0 is the initial model
            accs.append(acc)
        return MetricRecord({"accuracy": acc})

    n, m = len(train_sets), cfg.train.clients_per_round
    strategy = FedAvg(fraction_train=m / n, fraction_evaluate=0.0, min_train_nodes=m, min_evaluate_nodes=0,
                      min_available_nodes=n)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=cfg.train.rounds,
                   evaluate_fn=evaluate)
    RESULT.update(acc_final=accs[-1], acc_mean=sum(accs) / len(accs), rounds=len(accs))


def run() -> None:
    global ROUNDS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--cpus", type=int, default=os.cpu_count(), help="Ray's CPUs (one per client at a time)")
    args = ap.parse_args()
    os.environ["FLOWER_SIM_ROUNDS"] = str(args.rounds)  # the Ray actors read it when they import this module
    ROUNDS = args.rounds
    n = len(data()[2])
    run_simulation(server_app=server, client_app=client, num_supernodes=n,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": args.cpus, "_node_ip_address": "127.0.0.1"}})
    print(json.dumps(RESULT))


if __name__ == "__main__":
    # run as the module ``flower_sim``, not ``__main__``: Ray pickles ``__main__``'s functions by value, with the
    # globals they reach (the whole partition), into every message; a module's by reference
    import flower_sim

    flower_sim.run()
