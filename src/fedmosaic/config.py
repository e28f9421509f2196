"""Typed run configuration (YAML ⇄ pydantic). Every error becomes one line naming the field and what is allowed."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .engine.augment import AugmentConfig
from .engine.optim import OptimizerConfig
from .errors import ConfigError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataConfig(Strict):
    dataset: str = "digits"
    clients: int | None = Field(20, ge=1, description="number of clients; None = the scheme's own count")
    partition: dict[str, Any] = Field(default_factory=lambda: {"scheme": "dirichlet", "alpha": 0.3})
    pool: Literal["train", "all"] = Field(
        "train", description="partition the train split only, or train+test pooled (per-client test splits)"
    )
    client_test: float = Field(0.0, ge=0, lt=1, description="fraction of each client's samples held out as its test split")
    client_val: float = Field(0.0, ge=0, lt=1, description="fraction of each client's samples held out for validation")
    normalize: Literal["channel", "pixel", "none"] = Field(
        "channel", description="z-score inputs per channel, per pixel/feature (FedProx/APFL MNIST), or not at all"
    )
    augment: AugmentConfig = Field(default_factory=AugmentConfig, description="training-time augmentation")
    seed: int | None = Field(None, description="partition seed; defaults to the run seed")
    classes: list[int] | None = Field(None, description="keep only these class ids, relabelled 0..k-1 in this order")

    @model_validator(mode="after")
    def _fractions(self):
        if self.client_test + self.client_val >= 1:
            raise ValueError("client_test + client_val must be < 1")
        return self


class ArchConfig(Strict):
    name: str
    options: dict[str, Any] = Field(default_factory=dict)
    share: float = Field(1.0, gt=0, description="relative share of clients that get this architecture")


class ModelConfig(Strict):
    name: str = "mlp"
    options: dict[str, Any] = Field(default_factory=dict)
    task_loss: Literal["ce", "hinge"] = "ce"
    heterogeneous: list[ArchConfig] | None = Field(
        None, description="several architectures, assigned to clients round-robin by share (model-heterogeneous FL)"
    )


class AlgorithmConfig(BaseModel):
    """``name`` plus the algorithm's own hyper-parameters (validated by that algorithm's Config)."""

    model_config = ConfigDict(extra="allow")
    name: str = "fedavg"

    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class TrainConfig(Strict):
    rounds: int = Field(30, ge=1)
    clients_per_round: int = Field(10, ge=1)
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(10, ge=1)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)


class EngineConfig(Strict):
    backend: Literal["vectorized", "sequential"] = "vectorized"
    chunk_size: int = Field(128, ge=1, description="clients trained at once on the vectorized path (bounds memory)")
    device: str = Field("auto", description="'auto' (CUDA when available, else CPU), 'cpu', 'cuda', 'cuda:1', ...")
    compile: bool = Field(False, description="torch.compile the mapped gradient step (vectorized backend only)")
    fuse_steps: int = Field(8, ge=1, description="with compile: local steps per compiled call (fewer Python round trips)")
    preload_mb: int = Field(2048, ge=0, description="normalise the data once up front if it fits in this many MiB")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: torch's choice)")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v != "auto":
            import torch

            try:
                torch.device(v)
            except RuntimeError:
                raise ValueError(f"must be 'auto' or a torch device such as 'cpu' or 'cuda:0' (got {v!r})") from None
        return v


class EvalConfig(Strict):
    every: int = Field(1, ge=1, description="evaluate every N rounds (and always after the last)")
    global_test: bool = True
    client_test: bool = True
    local_models: bool = Field(
        False, description="also test the cohort's local models on the global test set: in-local / out-local accuracy"
    )


class RunConfig(Strict):
    name: str = "run"
    seed: int = 0
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint_every: int = Field(10, ge=1)
    compare: list[AlgorithmConfig] | None = Field(
        None, description="run these algorithms on the same partition, cohorts and batches and compare them"
    )

    def variants(self) -> list[RunConfig]:
        """One config per compared algorithm (or just this one)."""
        if not self.compare:
            return [self]
        names = [label(a) for a in self.compare]
        names = [n if names.count(n) == 1 else f"{n}#{names[:i].count(n) + 1}" for i, n in enumerate(names)]
        return [self.model_copy(update={"algorithm": a, "compare": None, "name": n}) for a, n in zip(self.compare, names)]


def label(algo: AlgorithmConfig) -> str:
    """A short readable name for an algorithm config, e.g. ``fedprox(mu=0.1)``."""
    params = ",".join(f"{k}={v}" for k, v in algo.params().items())
    return f"{algo.name}({params})" if params else algo.name


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """The first pydantic error as ``field.path: message (got value)``."""
    e = err.errors()[0]
    loc = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
    msg = e["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
    if e["type"] == "extra_forbidden":
        msg = "unknown field"
    got = e.get("input")
    shown = "" if e["type"] in ("missing", "extra_forbidden") or isinstance(got, dict) else f" (got {got!r})"
    return f"{loc or 'config'}: {msg}{shown}"


def validate(raw: dict) -> RunConfig:
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    from .algorithms import ALGORITHMS  # late import: algorithms import the engine

    from .data.partition import parse_partition
    from .data.registry import get_spec

    parse_partition(cfg.data.partition, prefix="data.partition")
    try:
        get_spec(cfg.data.dataset)
    except ConfigError as e:
        raise ConfigError(f"data.dataset: {e}") from None
    checks = [("algorithm", cfg.algorithm)] + [(f"compare.{i}", a) for i, a in enumerate(cfg.compare or [])]
    for where, a in checks:
        algo = ALGORITHMS.get(a.name)
        if algo is None:
            raise ConfigError(f"{where}.name: unknown {a.name!r}; allowed: {', '.join(sorted(ALGORITHMS))}")
        try:
            algo.Config.model_validate(a.params())
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, where)) from None
    return cfg


def parse_value(text: str) -> Any:
    """A ``--set`` value read as YAML, so ``0.1``, ``true``, ``[1, 2]`` and ``{scheme: iid}`` get their types."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. train.rounds=5")
        key, value = item.split("=", 1)
        node = raw
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {p!r} is not a section")
        node[parts[-1]] = parse_value(value)
    return raw


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            line = getattr(getattr(e, "problem_mark", None), "line", None)
            raise ConfigError(f"{p}: invalid YAML" + (f" near line {line + 1}" if line is not None else "")) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections (data, model, algorithm, train, ...)")
    return validate(apply_overrides(raw, list(overrides)))


def dump(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
