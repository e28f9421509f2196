"""Experiment trackers beside ``metrics.jsonl``: TensorBoard (``eval.tensorboard``), MLflow and Weights & Biases
(``eval.trackers``). Each receives every round's numbers — the columns of ``metrics.csv``, named with ``/`` as
TensorBoard groups them — at step = rounds done, the run's config once, and the summary at the end. Each is an
optional extra, asked for before anything is written; neither MLflow nor W&B needs a server:

- MLflow: the tracking URI of ``$MLFLOW_TRACKING_URI``, else a SQLite store in the run (``<run>/mlflow.db``; open it
  with ``mlflow ui --backend-store-uri sqlite:///<run>/mlflow.db``); the experiment is the run's name.
- W&B: ``$WANDB_MODE`` (default ``offline``: files under ``<run>/wandb``, uploaded later with ``wandb sync``); the
  project is the run's name.

A resumed run continues its tracker runs (their ids in ``<run>/trackers.json``); rounds recomputed after a crash
are logged again at their steps (W&B keeps the first value of a step).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

from ..errors import FedMosaicError
from ..files import atomic_write

EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def check(names: list[str]) -> None:
    """One line naming what to install for each tracker whose package is missing."""
    for name in names:
        try:
            if name == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            elif name == "mlflow":
                import mlflow  # noqa: F401
            else:
                import wandb  # noqa: F401
        except ImportError:
            where = "eval.tensorboard" if name == "tensorboard" else "eval.trackers"
            raise FedMosaicError(f"{where}: {name} needs its package: pip install 'fedmosaic[{EXTRAS[name]}]' (or "
                                 "leave it out)") from None


def wanted(cfg) -> list[str]:
    return (["tensorboard"] if cfg.eval.tensorboard else []) + list(cfg.eval.trackers)


class Trackers:
    """The run's trackers, opened at round ``start`` (0, or where a resumed run goes on)."""

    def __init__(self, cfg, out: Path, start: int, config: dict):
        self.out, self.open = Path(out), []
        ids_file = self.out / "trackers.json"
        ids = json.loads(ids_file.read_text()) if start > 0 and ids_file.is_file() else {}
        for name in wanted(cfg):
            self.open.append(_OPENERS[name](cfg, self.out, start, config, ids))
        if cfg.eval.trackers:
            atomic_write(ids_file, json.dumps(ids).encode())

    def log(self, named: dict[str, float], step: int) -> None:
        """``named``: a round's numbers by their path (``global/acc``: ``records.scalars(rec, "/")``)."""
        for tracker in self.open:
            tracker.log(named, step)

    def close(self, summary: dict[str, float] | None = None) -> None:
        """The run's summary (None: it stopped unfinished)."""
        for tracker in self.open:
            tracker.close(summary)


class _TensorBoard:
    def __init__(self, cfg, out, start, config, ids):
        from torch.utils.tensorboard import SummaryWriter

        # the events of rounds from `start` on (recomputed after a crash) replace those written before
        self.board = SummaryWriter(str(out / "tensorboard"), purge_step=start + 1)

    def log(self, named, step):
        for tag, value in named.items():
            self.board.add_scalar(tag, value, global_step=step)
        self.board.flush()

    def close(self, summary):
        self.board.close()


class _MLflow:
    def __init__(self, cfg, out, start, config, ids):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        self.client = MlflowClient(uri)
        if ids.get("mlflow"):
            self.run_id = ids["mlflow"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(cfg.name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(cfg.name)
            self.run_id = ids["mlflow"] = self.client.create_run(exp_id, run_name=out.name).info.run_id
            from mlflow.entities import Param

            # (params are write-once in MLflow: an amended resume's changes stay in meta.json)
            self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in config.items()])

    def log(self, named, step):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in named.items()]
        for i in range(0, len(metrics), 1000):  # (MLflow takes at most 1000 metrics a batch)
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self, summary):
        if summary:
            for k, v in summary.items():
                self.client.set_tag(self.run_id, f"summary/{k}", str(v))
        self.client.set_terminated(self.run_id, status="FINISHED" if summary is not None else "KILLED")


class _WandB:
    def __init__(self, cfg, out, start, config, ids):
        import wandb

        ids.setdefault("wandb", secrets.token_hex(6))
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=cfg.name, name=out.name, id=ids["wandb"], resume="allow", dir=str(out),
                              mode=os.environ.get("WANDB_MODE", "offline"), config=config)

    def log(self, named, step):
        self.run.log(named, step=step)

    def close(self, summary):
        if summary:
            self.run.summary.update(summary)
        self.run.finish(exit_code=0 if summary is not None else 1)


_OPENERS = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _WandB}
