"""The Python API: run or compare algorithms from a config and get the results as objects; register your own data
(numpy arrays) and model (a plain ``nn.Module``). Everything here is what the command line does, from Python:
the same run directories, the same checks, the same numbers.

A config is a dict (the sections of a YAML config), a YAML file, a preset name or a ``RunConfig``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from . import plugins
from .config import RunConfig, advise, algorithm_spec, load_config
from .data.registry import register_dataset
from .errors import ConfigError, FedMosaicError
from .models import register_model
from .presets import config_path
from .reports.compare import dir_name, run_all
from .runs.dirs import new_run_dir
from .runs.records import read_metrics, summarize

__all__ = ["Result", "compare", "register_dataset", "register_model", "run"]


@dataclass(frozen=True)
class Result:
    """One run: ``summary`` holds its headline numbers (``global_acc_final``, ``personal_acc_final``, ... — the
    columns of the CLI's table), ``metrics`` one record per finished round (``metrics.jsonl``), ``dir`` its run
    directory, ``config`` its resolved config."""

    name: str
    summary: dict
    metrics: list[dict]
    dir: Path
    config: RunConfig
    #: with ``seeds``: one Result per seed; ``summary`` is then their mean ± std (``<key>_std``), ``metrics`` empty
    seeds: tuple[Result, ...] = ()

    @classmethod
    def load(cls, run_dir: str | Path, plugins: list[str] = ()) -> Result:
        """The result of a run directory, finished or not (a comparison's variants are its sub-directories).
        ``plugins``: the modules that registered its dataset, models or algorithm (as ``--plugin``); without them an
        unknown name is an error that names the modules the run recorded."""
        from . import plugins as plug

        d = Path(run_dir)
        if not (d / "config.yaml").is_file():
            held = next((f for f in ("seeds.yaml", "comparison.yaml") if (d / f).is_file()), None)
            subs = sorted(p.name for p in d.iterdir() if (p / "config.yaml").is_file() or (p / "comparison.yaml")
                          .is_file()) if held else []
            raise FedMosaicError(f"{d} is not a run directory (no config.yaml)" + (
                f"; it holds {'several seeds' if held == 'seeds.yaml' else 'a comparison'}: load one of its "
                f"directories ({', '.join(subs[:4])}{', ...' if len(subs) > 4 else ''})" if held else ""))
        plug.load([plugins] if isinstance(plugins, str) else list(plugins))  # (one module's name alone, too)
        plug.expect([d])
        with plug.in_python():
            cfg = load_config(d / "config.yaml")
        metrics = read_metrics(d)
        return cls(cfg.name, summarize(metrics, cfg), metrics, d, cfg)

    @property
    def accuracy(self) -> float | None:
        """The final test accuracy of what the method is judged by: on a task stream, the accuracy on every class
        seen after the last task; for a personalized method, the clients' own models' (sample-weighted); else the
        global model's (on the global test set, else on the clients' test splits). The others are in ``summary``."""
        from .protocol.algorithm import registered

        keys = ["global_acc_final", "global_clients_acc_final", "personal_acc_final"]
        algo = registered().get(self.config.algorithm.name)
        if algo is not None and algo.personalized:
            keys.insert(0, "personal_acc_final")
        if self.config.data.tasks is not None:
            keys.insert(0, "continual_final")
        return next((self.summary[k] for k in keys if k in self.summary), None)

    def __repr__(self) -> str:
        acc = "-" if self.accuracy is None else f"{self.accuracy:.4f}"
        return f"Result({self.name!r}, rounds={self.summary['rounds']}, accuracy={acc}, dir={str(self.dir)!r})"


def run(config, out: str | Path | None = None, *, seeds: list[int] | None = None, resume: bool = False,
        amend: bool = False, progress: bool = True) -> Result:
    """Run one algorithm (``config``'s) in ``out`` (default: a new directory under ./runs, as the CLI names it),
    once per seed of ``seeds`` if given (see ``compare``).
    ``resume=True`` continues ``out`` from its last checkpoint: give its saved config (``out / "config.yaml"``), or
    with ``amend=True`` one that changes what the CLI's ``--amend`` may (e.g. more rounds)."""
    cfg = _config(config)
    if len(cfg.variants()) > 1:
        raise ConfigError(f"run: the config compares {len(cfg.variants())} algorithms (compare:); use "
                          "fedmosaic.compare for it")
    return compare(cfg, out=out, seeds=seeds, resume=resume, amend=amend, progress=progress)[0]


def compare(config, algorithms: list[str | dict] | None = None, out: str | Path | None = None, *,
            seeds: list[int] | None = None, resume: bool = False, amend: bool = False, progress: bool = True
            ) -> list[Result]:
    """Run several algorithms on the same partition, cohorts and batches; one Result per algorithm, in order.

    ``algorithms``: names or ``"name:key=value,..."`` as the CLI's ``--algorithms`` (``"fedprox:mu=0.1"``), or dicts
    (``{"name": "fedprox", "mu": 0.1}``); default: the config's ``compare`` section. ``seeds``: run everything once
    per seed (as ``--seeds``); each Result then holds the mean ± std over them and the per-seed Results. ``out`` as
    for ``run``; a comparison is resumed from its ``out / "comparison.yaml"`` (over seeds: ``seeds.yaml``)."""
    cfg = _config(config, algorithms, seeds)
    if not resume:
        advise(cfg, compare_given=algorithms is not None)
    reserved = out is None
    out = new_run_dir("runs", cfg.name) if reserved else Path(out)
    try:
        summaries = run_all(cfg, out, resume=resume, amend=amend, progress=progress)
    finally:
        if reserved and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # failed before writing anything: leave no empty run directory (as the CLI)
    variants = cfg.variants()

    def where(base: Path, v: RunConfig) -> Path:
        return base if len(variants) == 1 else base / dir_name(v.name)

    if not cfg.seeds:
        return [Result.load(where(out, v)) for v in variants]
    return [Result(v.name, s, [], out, cfg, tuple(Result.load(where(out / f"seed_{seed}", v)) for seed in cfg.seeds))
            for v, s in zip(variants, summaries, strict=True)]


def _config(config, algorithms: list[str | dict] | None = None, seeds: list[int] | None = None) -> RunConfig:
    """A validated config from any of the accepted forms, the algorithms to compare replacing its own."""
    plugins.load()  # $FEDMOSAIC_PLUGINS and installed plug-ins, as the CLI sees them
    updates: dict = {} if seeds is None else {"seeds": list(seeds)}
    if algorithms is not None:
        if isinstance(algorithms, (str, dict)) or not algorithms:
            raise ConfigError("algorithms: a non-empty list of names or dicts, e.g. ['fedavg', 'fedprox:mu=0.1']")
        updates["compare"] = [copy.deepcopy(a) if isinstance(a, dict) else algorithm_spec(a) for a in algorithms]
    if isinstance(config, (str, Path)):
        return load_config(config_path(str(config)), updates=updates)
    if isinstance(config, RunConfig):
        config = config.model_dump(mode="json")
    if not isinstance(config, dict):
        raise ConfigError(f"config: a dict, a YAML file, a preset name or a RunConfig (got {type(config).__name__})")
    return load_config(None, updates={**copy.deepcopy(config), **updates})
