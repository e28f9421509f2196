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
import logging
import os
import secrets
import time
import warnings
from pathlib import Path

from ..errors import FedMosaicError, one_line
from ..files import atomic_write, set_aside

EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


#: what ``$WANDB_MODE`` may be (W&B 0.31's settings)
WANDB_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")


def check(names: list[str]) -> None:
    """One line naming what to install for each tracker whose package is missing, or a ``$WANDB_MODE`` W&B would
    refuse (both before anything is written)."""
    mode = os.environ.get("WANDB_MODE")
    if "wandb" in names and mode is not None and mode not in WANDB_MODES:
        raise FedMosaicError(f"WANDB_MODE: one of {', '.join(WANDB_MODES)} (got {mode[:40]!r}); unset it for "
                             "offline")
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
        ids = _ids(ids_file) if start > 0 and ids_file.is_file() else {}
        for name in wanted(cfg):
            try:
                self.open.append(_OPENERS[name](cfg, self.out, start, config, ids))
            except Exception as e:  # the libraries raise their own kinds (a URI MLflow has no store for, ...)
                self.close(None)
                raise FedMosaicError(f"eval.trackers: {name} could not start: {one_line(e, 200)}") from None
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


def _ids(path: Path) -> dict:
    """The tracker run ids a run saved (``trackers.json``); a damaged file is set aside with a warning, and the
    trackers start new runs of their own."""
    try:
        ids = json.loads(path.read_text())
        if isinstance(ids, dict) and all(isinstance(v, str) for v in ids.values()):
            return ids
    except (OSError, ValueError):
        pass
    aside = set_aside(path, ".corrupt")
    warnings.warn(f"{path} is damaged (set aside as {aside.name}); the trackers continue in new runs of their own",
                  stacklevel=3)
    return {}


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
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # (its INFO lines on stderr: not the user's concern)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        self.client = MlflowClient(uri)
        if ids.get("mlflow"):
            try:
                self.client.update_run(ids["mlflow"], status="RUNNING")
                self.run_id = ids["mlflow"]
            except MlflowException:  # another tracking URI now, or its store deleted
                warnings.warn(f"MLflow has no run {ids['mlflow']} at {uri}; the run continues in a new MLflow run "
                              f"from round {start}", stacklevel=3)
                del ids["mlflow"]
        if not ids.get("mlflow"):
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
