"""Typed run configuration (YAML ⇄ pydantic). Every error becomes one line naming the field and what is allowed."""

from __future__ import annotations

import difflib
import re
import typing
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import plugins
from .data.partition.tasks import count_range
from .engine.client.augment import AugmentConfig
from .engine.client.optim import OptimizerConfig
from .errors import ConfigError, FedMosaicError
from .protocol.algorithm import registered
from .schema import MAX_COUNT, MAX_SEED, Schema, unused

#: A config file larger than this is not a config (a YAML alias bomb or a wrong file).
MAX_CONFIG_BYTES = 1 << 20
#: Values (scalars, list items, mapping entries) a config may hold once YAML aliases are expanded.
MAX_CONFIG_NODES = 100_000
#: Run names become directory names (plus a time stamp): one path component, at most this many UTF-8 bytes.
MAX_NAME_BYTES = 100
_BAD_NAME = re.compile(r"[/\\\x00-\x1f\x7f]")


def check_name(name: str) -> str:
    """A run name is a name, not a path: it never creates anything outside the runs directory."""
    if not name.strip():
        raise ValueError("must not be empty")
    if _BAD_NAME.search(name):
        raise ValueError("must be a plain name, not a path: no '/', '\\' or control characters")
    if name in (".", "..") or name != name.strip():
        raise ValueError("must not be '.', '..' or start or end with spaces")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise ValueError(f"must be at most {MAX_NAME_BYTES} bytes long (got {len(name.encode())})")
    return name


class PublicConfig(Schema):
    """The shared public stream of model-heterogeneous FL: what clients exchange outputs on."""

    source: str = Field("noise", min_length=1, description="'noise': uniform [0, 1) inputs of the private shape "
                        "(AHF's N0); or a dataset name: its train images, resized to the private size and channels")
    size: int = Field(5000, ge=1, le=10**6, description="samples in the stream (N0)")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="defaults to the run seed")


class MemoryConfig(Schema):
    """Every client's exemplar memory: samples of its earlier tasks it keeps and trains on again (replay)."""

    per_class: int | None = Field(None, ge=1, le=MAX_COUNT, description="strategy A: keep this many per class")
    total: int | None = Field(None, ge=1, le=MAX_COUNT,
                              description="strategy B: keep this many in all, shared equally by the classes met")
    select: Literal["auto", "nearest", "herding", "random"] = Field(
        "auto", description="which samples: nearest to the class prototype (ProtoFCL), herding (iCaRL), random; "
        "'auto': the algorithm's choice")

    @model_validator(mode="after")
    def _budget(self):
        if (self.per_class is None) == (self.total is None):
            raise ValueError("memory: set exactly one of per_class (a count per class) and total (one budget)")
        return self


class TasksConfig(Schema):
    """Class-incremental task streams (ProtoFCL): the classes cut into tasks, each client trains on one task at a
    time, ``rounds_per_task`` rounds each."""

    n_tasks: int = Field(ge=1, le=MAX_COUNT)
    classes_per_task: int | None = Field(None, ge=1, le=MAX_COUNT, description="default: classes / n_tasks")
    rounds_per_task: int = Field(10, ge=1, le=MAX_COUNT)
    order: Literal["shared", "random"] = Field(
        "shared", description="every client meets the tasks in one order (stage j is task j; a client without "
        "samples of a task sits its stage out), or each in its own random order")
    tasks_per_client: int | list[int] | None = Field(
        None, description="default: every task; a pair [lo, hi]: each client a random count in lo..hi")
    memory: MemoryConfig | None = Field(None, description="exemplar memory (replay); none by default")

    @model_validator(mode="after")
    def _counts(self):
        count_range(self.tasks_per_client, self.n_tasks)
        return self


class DataConfig(Schema):
    dataset: str = Field("digits", min_length=1)
    clients: int | None = Field(20, ge=1, le=MAX_COUNT, description="number of clients; None = the scheme's own count")
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
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="partition seed; defaults to the run seed")
    classes: list[int] | None = Field(None, min_length=1, description="keep only these class ids, relabelled 0..k-1 "
                                      "in this order")
    public: PublicConfig | None = Field(None, description="a shared public stream (noise or an unlabeled dataset)")
    tasks: TasksConfig | None = Field(None, description="class-incremental task streams (continual learning)")

    @field_validator("classes")
    @classmethod
    def _classes(cls, v):
        if v is not None and (min(v) < 0 or len(set(v)) != len(v)):
            raise ValueError(f"must be distinct class ids >= 0 (got {v})")
        return v

    @model_validator(mode="after")
    def _fractions(self):
        if self.client_test + self.client_val >= 1:
            raise ValueError("client_test + client_val must be < 1")
        return self


class ArchConfig(Schema):
    name: str = Field(min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)
    share: float = Field(1.0, gt=0, le=1e6, description="relative share of clients that get this architecture")


class ModelConfig(Schema):
    name: str = Field("mlp", min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)
    task_loss: Literal["ce", "hinge"] = "ce"
    heterogeneous: list[ArchConfig] | None = Field(
        None, min_length=1,
        description="several architectures, assigned to clients round-robin by share (model-heterogeneous FL)"
    )
    assign: list[int] | None = Field(
        None, min_length=1, description="with heterogeneous: client k gets architecture assign[k] (instead of shares)")
    init: Literal["auto", "shared", "own"] = Field(
        "auto", description="'shared': every client of an architecture starts from one initialisation; 'own': each "
        "from its own; 'auto': own with heterogeneous architectures, else shared")

    @model_validator(mode="after")
    def _assign(self):
        if self.assign is not None:
            n = len(self.heterogeneous or [])
            if not n:
                raise ValueError("model.assign: needs model.heterogeneous (the architectures it indexes)")
            if min(self.assign) < 0 or max(self.assign) >= n:
                raise ValueError(f"model.assign: indices into model.heterogeneous, in [0, {n}) (got {self.assign})")
        return self


class AlgorithmConfig(BaseModel):
    """``name`` plus the algorithm's own hyper-parameters (validated by that algorithm's Config)."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str = "fedavg"
    memory: MemoryConfig | Literal[False] | None = Field(
        None, description="with data.tasks: this algorithm's exemplar memory instead of data.tasks.memory (false: "
        "none) — so one comparison holds fine-tuning and replay, a method and its ablation without memory")

    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class TrainConfig(Schema):
    rounds: int = Field(30, ge=1, le=MAX_COUNT)
    clients_per_round: int = Field(10, ge=1, le=MAX_COUNT)
    local_epochs: int = Field(1, ge=1, le=MAX_COUNT)
    batch_size: int = Field(10, ge=1, le=MAX_COUNT, description="capped at the largest client's train size")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    warmup_epochs: int = Field(0, ge=0, le=MAX_COUNT, description="before round 0, every client trains its own "
                               "model on its private data for this many epochs (model-heterogeneous FL)")


class RayConfig(Schema):
    """Where ``engine.pool: ray`` runs its clients: ``actors`` Ray actors, each hosting a contiguous shard of the
    client ids (their data rows, states and exemplar memory) and training them as this process would."""

    address: str | None = Field(
        None, description="the Ray cluster: 'host:port' of its head (started with `ray start --head`), 'auto' (the "
        "one started on this machine), or none: a Ray runtime of this process's own, on this machine")
    actors: int = Field(2, ge=1, le=4096, description="the actors the clients are sharded over")
    cpus_per_actor: float = Field(1.0, gt=0, le=1024, description="CPUs Ray reserves per actor; its torch threads: "
                                  "this rounded up (engine.threads overrides)")
    gpus_per_actor: float = Field(0.0, ge=0, le=64, description="GPUs Ray reserves per actor (its clients then train "
                                  "on its GPU; engine.device: auto)")
    object_store_mb: int = Field(512, ge=80, le=MAX_COUNT, description="the object store of a Ray runtime this "
                                 "process starts itself (address: none)")
    restarts: int = Field(3, ge=0, le=1000, description="how often a run that lost an actor (its process killed, "
                          "its node gone) replays from its last checkpoint on new actors before it stops")
    start_timeout_s: float = Field(120.0, gt=0, le=86_400, description="how long the actors may take to be placed "
                                   "and start before the run stops in one line (too few CPUs, GPUs or memory)")


class EngineConfig(Schema):
    backend: Literal["auto", "vectorized", "sequential"] = Field(
        "auto", description="'auto' chooses per model, device and run length (printed at run start, kept in "
        "meta.json); 'vectorized' maps clients with torch.func.vmap; 'sequential' loops over them (plain autograd)")
    chunk_size: int = Field(128, ge=1, le=MAX_COUNT,
                            description="clients trained at once on the vectorized path (bounds memory)")
    device: str = Field("auto", description="'auto' (CUDA when available, else CPU), 'cpu', 'cuda', 'cuda:1', 'mps'")
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile the mapped gradient step (vectorized backend only); 'auto': when the run "
        "is long enough to repay the one-time warm-up")
    fuse_steps: int = Field(8, ge=1, le=1024,
                            description="with compile: local steps per compiled call (fewer Python round trips)")
    preload_mb: int = Field(2048, ge=0, le=MAX_COUNT,
                            description="normalise the data once up front if it fits in this many MiB")
    pool: Literal["local", "wire", "ray"] = Field(
        "local", description="where the clients run: 'local', all in this process's one runtime (the fast, stacked "
        "path); 'wire', each in a runtime of its own, every message through the codec as bytes (slower; the same "
        "numbers; proves an algorithm talks only in messages, as a deployment needs); 'ray', shards of clients on "
        "Ray actors (engine.ray; pip install 'fedmosaic[ray]'), each holding only its clients' data and state")
    ray: RayConfig = Field(default_factory=lambda: RayConfig(), description="the actors of engine.pool: ray")
    memory_mb: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="the memory one process of the run may use, in MiB (what it is refused "
        "up front beyond); default: the device's (a GPU's, else the machine's or its cgroup's limit). With "
        "engine.pool: ray each actor holds its own shard's client states within it (and reserves it from Ray)")
    deterministic: bool = Field(
        True, description="on CUDA, deterministic kernels only (torch.use_deterministic_algorithms, cuDNN's "
        "deterministic convolutions, no cuDNN autotuning): a run and its resume give the same numbers, bit for bit, "
        "on the same GPU and software; false: faster, the same numbers within float rounding. (The CPU is "
        "deterministic either way.)")
    tf32: bool = Field(
        False, description="on CUDA (Ampere and later), TensorFloat-32 for matrix products and convolutions: faster, "
        "about 1e-3 relative error per product; false: full float32, as on the CPU")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="the models' forward passes (training and evaluation) under autocast: 'bf16' (CPUs "
        "with bf16 matrix units, Ampere and later GPUs); the parameters, optimizer states, losses and aggregation "
        "stay float32. 'fp16' (CUDA only): the same with a dynamic loss scale per client (an overflowing step is "
        "computed again at half the scale, never skipped). 'fp32': no autocast")
    denormals: Literal["keep", "flush"] = Field(
        "keep", description="CPU: 'flush' computes with subnormal floats (magnitudes below 1.2e-38) as zero "
        "(torch.set_flush_denormal: x86's FTZ/DAZ flags), since arithmetic on them is many times slower and a "
        "confident model makes them (softmax probabilities of classes a client never sees, and the gradients they "
        "carry back: a pFedSRB round 1.5-2x slower late in a run); process-wide, for numpy and the rest of the "
        "process too; a warning where torch's threads started earlier without it (a fresh process flushes on "
        "every thread). 'keep': the process's floating-point mode left as it is (IEEE gradual underflow unless "
        "something else set it; a warning where it flushes)")
    threads: int | None = Field(
        None, ge=1, le=1024, description="torch CPU threads (kept as set). Default: OMP_NUM_THREADS if set, else the "
        "cores this process may use (CPU affinity, cgroup quota), divided by FEDMOSAIC_PARALLEL_RUNS (runs sharing "
        "the machine), less the cores other processes keep busy at its start — never more threads than free cores")

    @field_validator("backend", mode="before")
    @classmethod
    def _backend(cls, v):
        if v not in ("auto", "vectorized", "sequential"):
            raise ValueError(f"must be 'vectorized' or 'sequential', or 'auto' to let fedmosaic choose (got {v!r})")
        return v

    @field_validator("compile", mode="before")
    @classmethod
    def _compile(cls, v):
        if v is not True and v is not False and v != "auto":
            raise ValueError(f"must be true, false or 'auto' (got {short_repr(v)})")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v != "auto":
            import torch

            try:
                kind = torch.device(v).type
            except (RuntimeError, ValueError):
                kind = None
            if kind not in ("cpu", "cuda", "mps"):  # meta, xla, ...: nothing the engine can train on
                raise ValueError(f"must be 'auto', 'cpu', 'mps' or a CUDA device such as 'cuda:0' (got {v!r})")
        return v


class AggregationConfig(Schema):
    """A robust stage between the cohort's uploads and the algorithm's weighted mean of them (docs/design.md
    "Robust aggregation"), on each client's update relative to the broadcast model."""

    rule: Literal["mean", "norm_bound", "median", "trimmed_mean", "krum", "bulyan"] = Field(
        "mean", description="mean: the algorithm's own (no stage); norm_bound: each update clipped to norm clip; "
        "median / trimmed_mean: coordinate-wise (unweighted, as Yin et al. 2018); krum: Multi-Krum's m updates of "
        "lowest score (Blanchard et al. 2017; m = 1 is Krum), averaged with their weights; bulyan: n - 2f updates "
        "chosen by Krum one after another, then per coordinate the mean of the n - 4f closest to their median "
        "(El Mhamdi et al. 2018; needs n >= 4f + 3)")
    clip: float | None = Field(None, gt=0, description="norm_bound: the largest update norm kept")
    trim: float = Field(0.1, ge=0, lt=0.5, description="trimmed_mean: the fraction cut at each end per coordinate")
    f: int = Field(1, ge=0, le=MAX_COUNT, description="krum, bulyan: the Byzantine clients tolerated (krum needs "
                   "n > 2f + 2, bulyan n >= 4f + 3)")
    m: int = Field(1, ge=1, le=MAX_COUNT, description="krum: the updates kept and averaged (1: Krum)")
    optimizer: Literal["none", "adam", "yogi", "adagrad", "avgm"] = Field(
        "none", description="a server optimizer on the aggregate's change of the global model, as a pseudo-gradient "
        "(Reddi et al. 2021; Flower's FedAdam / FedYogi / FedAdagrad rules; avgm: FedAvgM's server momentum, Hsu "
        "et al. 2019, the rule of Flower's FedAvgM and of algorithm fedavgm)")
    eta: float | None = Field(None, gt=0, description="the server learning rate (default: Flower's for the "
                              "optimizer: adam 0.1, yogi 0.01, adagrad 0.1, avgm 1.0)")
    beta1: float | None = Field(None, ge=0, lt=1, description="momentum (default 0.9; adagrad has none)")
    beta2: float | None = Field(None, ge=0, lt=1, description="second-moment decay (default 0.99; not adagrad)")
    tau: float | None = Field(None, gt=0, description="adaptivity (default: adam 1e-9, yogi 1e-3, adagrad 1e-9)")

    @model_validator(mode="after")
    def _clip(self):
        if self.rule == "norm_bound" and self.clip is None:
            raise ValueError("aggregation: rule norm_bound needs clip (the largest update norm kept, e.g. 1.0)")
        server = {"eta", "beta1", "beta2", "tau"}
        unused(self, "rule", {"norm_bound": {"clip"}, "trimmed_mean": {"trim"}, "krum": {"f", "m"}, "bulyan": {"f"}},
               {"optimizer"} | server)
        unused(self, "optimizer", {"adam": server, "yogi": server, "adagrad": {"eta", "tau"}, "avgm": {"eta", "beta1"}},
               {"rule", "clip", "trim", "f", "m"})
        return self


class AdaptiveClipConfig(Schema):
    """Andrew et al. 2021: after each round the clip moves geometrically towards the ``quantile`` of the cohort's
    update norms, from a noised count of the updates it left unclipped."""

    quantile: float = Field(0.5, ge=0, le=1, description="the fraction of updates the clip should leave unclipped")
    lr: float = Field(0.2, gt=0, description="the clip's geometric learning rate")
    count_noise: float = Field(description="std of the noise on the count of unclipped updates (the paper: m / 20)")


class ParticipationConfig(Schema):
    """Who takes part in the rounds (the simulation settings of FL-bench and PFLlib): every draw from the run seed,
    the round and the client, so every algorithm, backend and pool of a comparison sees the same clients."""

    dropout: float = Field(0.0, ge=0, lt=1, description="the chance that a client chosen for a round drops out before "
                           "it answers (drawn per seed, round and client); the round aggregates the others, and if "
                           "every chosen client dropped, the one with the lowest draw stays")
    stragglers: float = Field(0.0, ge=0, le=1, description="the chance that a client of a round is a straggler: it "
                              "runs only a share of each phase's local steps, drawn uniformly in (0, 1] (at least one "
                              "step), per seed, round and client (FedProx's systems heterogeneity)")
    held_out: float = Field(0.0, ge=0, lt=1, description="the fraction of clients that never train (drawn once from "
                            "the seed, at least one): evaluated apart as they are — the global model, or their "
                            "personal model untrained or fine-tuned — under held_out in the metrics")


class PrivacyConfig(Schema):
    """Client-level differential privacy, central (DP-FedAvg, McMahan et al. 2018): every update clipped to ``clip``,
    the cohort's uniform mean, Gaussian noise of std ``noise`` * clip / m added on the server; the privacy spent is
    accounted per round (RDP, dp-accounting: fixed-size cohorts sampled without replacement). Local: each client
    clips its own update and adds noise of std ``noise`` * clip before it uploads (the server sees no clean update)."""

    mode: Literal["central", "local"] = Field(
        "central", description="central: the server clips and noises the mean (trusted server); local: each client "
        "clips and noises its own upload (epsilon per client, every round it takes part, no sampling amplification)")
    noise: float = Field(ge=0, description="the noise multiplier sigma (noise std / clip; central: before the 1/m)")
    clip: float = Field(gt=0, description="the largest update norm a client contributes (the sensitivity)")
    delta: float = Field(1e-5, gt=0, lt=1, description="the delta of the reported (epsilon, delta)")
    max_epsilon: float | None = Field(None, gt=0, description="stop before the round that would spend more")
    adaptive: AdaptiveClipConfig | None = Field(None, description="adaptive clipping (Andrew et al. 2021): clip "
                                               "follows a quantile of the update norms; none: clip stays fixed")

    @model_validator(mode="after")
    def _count_noise(self):
        if self.mode == "local" and self.adaptive is not None:
            raise ValueError("privacy.adaptive: adaptive clipping counts the unclipped updates on the server, which a "
                             "local mechanism never shows it; use a fixed clip with mode local")
        a = self.adaptive
        if a is not None and self.noise > 0 and not 2 * a.count_noise > self.noise:
            raise ValueError(f"privacy.adaptive.count_noise: the clipped count's noise takes part of the privacy "
                             f"budget, so it must exceed noise / 2 = {self.noise / 2:g} (got {a.count_noise:g})")
        return self


class AttackConfig(Schema):
    """Simulated Byzantine clients (for studying defences): a fixed set chosen by the run seed, whose uploads are
    replaced on their way to the server, the same on every pool."""

    kind: Literal["scale", "sign_flip", "noise", "free_rider", "label_flip"] = Field(
        description="scale: the update times factor; sign_flip: minus the update times factor; noise: the update "
        "plus Gaussian noise of std sigma; free_rider: no update (the broadcast model sent back); label_flip: the "
        "attackers train honestly on labels y -> C - 1 - y (Tolpegin et al. 2020; any algorithm)")
    fraction: float = Field(0.1, gt=0, le=1, description="the share of all clients that attack (rounded up)")
    factor: float = Field(1000.0, description="scale and sign_flip: the multiplier")
    sigma: float = Field(1.0, ge=0, description="noise: the std of the added noise, per coordinate")

    @model_validator(mode="after")
    def _used(self):
        unused(self, "kind", {"scale": {"factor"}, "sign_flip": {"factor"}, "noise": {"sigma"}}, {"fraction"})
        return self


class DeployConfig(Schema):
    """How a deployed run (``fedmosaic deploy``: a Flower SuperLink and one SuperNode per client) treats its nodes;
    a simulation ignores it."""

    min_clients: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="a round goes on with the clients that answered when at least this many "
        "did (the others are recorded in the round's metrics), else the run stops and can be resumed; default: "
        "every client asked")
    round_timeout_s: float = Field(300.0, gt=0, le=86_400,
                                   description="how long the server waits for the answers to one request")
    connect_timeout_s: float = Field(300.0, gt=0, le=86_400,
                                     description="how long the server waits for every client's node to connect")
    max_reply_mb: float = Field(512.0, gt=0, le=1 << 20,
                                description="a reply larger than this is rejected unread (a hostile or broken node)")


class EvalConfig(Schema):
    every: int = Field(1, ge=1, le=MAX_COUNT, description="evaluate every N rounds (and always after the last)")
    report_every: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="also the algorithm's measures of its clients' states (its report: "
        "ProtoFCL's prototype geometry, pFedSRB's sparsity) every N rounds between evaluations; they read no data, "
        "but a deployment asks its nodes once more. null: with each evaluation only")
    global_test: bool = True
    client_test: bool = True
    split: Literal["test", "val"] = Field(
        "test", description="the held-out samples of the global evaluations (the global model's accuracy, the "
        "continual accuracy after each task): 'test' the dataset's test split; 'val' the clients' validation splits "
        "pooled (data.client_val > 0) — to choose hyper-parameters without looking at the test data")
    local_models: bool = Field(
        False, description="also test the cohort's local models on the global test set: in-local / out-local accuracy"
    )
    start: bool = Field(
        False, description="also evaluate the starting model before the first round (round 0 of the FedProx "
        "framework, which tests before it trains; the APFL-PD paper's means count from it): 'start' in the first "
        "round's line, and summaries add <model>_acc_mean_from_start, the mean over it and every evaluation")
    cross_clients: bool = Field(
        False, description="the K x K matrix of client i's model on client j's test split, with intra-domain "
        "(diagonal) and inter-domain (off-diagonal) accuracy (personalized and model-heterogeneous algorithms)")
    continual_sample: int | None = Field(
        10_000, ge=1, le=MAX_COUNT, description="data.tasks: a continual evaluation makes at most this many "
        "predictions (models x test samples of the seen classes), so its cost stays flat as classes accumulate; "
        "beyond it every model (the global one, or each client's own) judges its share of a fixed class-stratified "
        "sample, the same for every method. null: every model on every sample (exact; the default's numbers too "
        "when models x samples fit, e.g. a global model on CIFAR-100's 10,000)")
    tensorboard: bool = Field(False, description="also write every round's numbers as TensorBoard event files in "
                              "<run>/tensorboard (needs the tensorboard package: pip install 'fedmosaic[tensorboard]')")
    trackers: list[Literal["mlflow", "wandb"]] = Field(
        default_factory=list, max_length=2, description="experiment trackers that also get every round's numbers, "
        "the config and the summary: mlflow ($MLFLOW_TRACKING_URI, else a SQLite store <run>/mlflow.db; pip install "
        "'fedmosaic[mlflow]'), wandb ($WANDB_MODE, default offline: <run>/wandb; pip install 'fedmosaic[wandb]')")

    @field_validator("trackers")
    @classmethod
    def _trackers(cls, v):
        if len(set(v)) != len(v):
            raise ValueError(f"each tracker once (got {v})")
        return v


class RunConfig(Schema):
    name: str = Field("run", description="a plain name (no path); run directories are <runs-dir>/<name>-<time>")
    seed: int = Field(0, ge=0, le=MAX_SEED)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    deploy: DeployConfig = Field(default_factory=DeployConfig)
    aggregation: AggregationConfig | None = Field(None, description="a robust aggregation stage (none: the "
                                                  "algorithm's own weighted mean)")
    attack: AttackConfig | None = Field(None, description="simulated attacking clients (none: every client honest)")
    privacy: PrivacyConfig | None = Field(None, description="client-level differential privacy (none: off)")
    participation: ParticipationConfig | None = Field(None, description="clients that drop out of rounds and clients "
                                                      "held out of training (none: every chosen client answers)")
    checkpoint_every: int = Field(10, ge=1, le=MAX_COUNT)
    compare: list[AlgorithmConfig] | None = Field(
        None, min_length=1,
        description="run these algorithms on the same partition, cohorts and batches and compare them"
    )
    seeds: list[int] | None = Field(
        None, min_length=1, max_length=1000,
        description="run (or compare) once per seed, each in <out>/seed_<s> with seed: s (and its own partition "
        "unless data.seed is set); the table gives the mean ± std over the seeds, the curves a band")

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v):
        if v is not None and (len(set(v)) != len(v) or min(v) < 0 or max(v) > MAX_SEED):
            raise ValueError(f"must be distinct seeds in [0, {MAX_SEED}] (got {short_repr(v)})")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v)

    @model_validator(mode="after")
    def _cohort(self):
        if self.data.tasks is None and any(a.memory is not None for a in [self.algorithm, *(self.compare or [])]):
            raise ValueError("algorithm.memory: an exemplar memory needs task streams (data.tasks)")
        tc = self.data.tasks
        if tc is not None and tc.rounds_per_task > self.train.rounds:  # no task would end: nothing to measure
            raise ValueError(f"data.tasks.rounds_per_task: a task of {tc.rounds_per_task} rounds never ends within "
                             f"train.rounds = {self.train.rounds}; at most {self.train.rounds}")
        if self.eval.split == "val" and not self.data.client_val:
            raise ValueError("eval.split: 'val' evaluates on the clients' validation splits, which data.client_val: 0 "
                             "leaves empty; set data.client_val (e.g. 0.1)")
        if self.eval.start and self.data.tasks is not None:
            raise ValueError("eval.start: a task stream is judged after each task (its continual accuracy), not before "
                             "the first round; set eval.start: false with data.tasks")
        if self.eval.cross_clients and not self.eval.client_test:
            raise ValueError("eval.cross_clients: the matrix is measured on the clients' test splits, which "
                             "eval.client_test: false leaves untested; set eval.client_test: true")
        if self.data.clients is not None and self.train.clients_per_round > self.data.clients:
            raise ValueError(f"train.clients_per_round: must be <= data.clients = {self.data.clients} "
                             f"(got {self.train.clients_per_round})")
        return self

    def variants(self) -> list[RunConfig]:
        """One config per compared algorithm (or just this one)."""
        if not self.compare:
            return [self]
        names = [label(a) for a in self.compare]
        # two entries whose labels (or their directory names: hidden=8 and hidden=[8]) are one get #1, #2
        same = [dir_name(n) for n in names]
        names = [n if same.count(k) == 1 else f"{n}#{same[:i].count(k) + 1}" for i, (n, k) in enumerate(zip(names, same))]
        names = [_BAD_NAME.sub("_", n)[:MAX_NAME_BYTES] for n in names]  # labels stay valid run names
        return [self.model_copy(update={"algorithm": a, "compare": None, "name": n}) for a, n in zip(self.compare, names)]

    def with_seed(self, seed: int) -> RunConfig:
        """This config for one of its ``seeds``."""
        return self.model_copy(update={"seed": seed, "seeds": None})

    def exemplar_memory(self) -> MemoryConfig | None:
        """The run's exemplar memory: the algorithm's own choice (``algorithm.memory``), else data.tasks.memory."""
        if self.data.tasks is None:
            return None
        mine = self.algorithm.memory
        return self.data.tasks.memory if mine is None else mine or None


def dir_name(label: str) -> str:
    """The directory of a compared variant, from its label."""
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", label).strip("_")


def label(algo: AlgorithmConfig) -> str:
    """A short readable name for an algorithm config, e.g. ``fedprox(mu=0.1)``."""
    extra = {} if algo.memory is None else {"memory": "off" if algo.memory is False else ",".join(
        f"{k}:{v}" for k, v in algo.memory.model_dump().items() if v is not None)}
    params = ",".join(f"{k}={v}" for k, v in {**algo.params(), **extra}.items())
    return f"{algo.name}({params})" if params else algo.name


def _model_in(tp) -> type[BaseModel] | None:
    """The config section class inside an annotation such as ``list[ArchConfig] | None``."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp):
        if (found := _model_in(arg)) is not None:
            return found
    return None


def _fields_at(model: type[BaseModel] | None, loc: tuple) -> list[str]:
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if model is not None else None
        model = _model_in(field.annotation) if field is not None else None
    return list(model.model_fields) if model is not None else []


_TEXT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def as_yaml_float(text: str) -> str:
    """``1e-3`` as YAML 1.1 reads a float: a dot in the mantissa and a sign in the exponent (``1.0e-3``)."""
    mantissa, exponent = text.lower().split("e")
    if "." not in mantissa:
        mantissa += ".0"
    return f"{mantissa}e{exponent if exponent[0] in '+-' else '+' + exponent}"


def yaml_scalar(value) -> str:
    """``value`` as it must be written in YAML (or ``--set``) to be read back as the same value."""
    return yaml.safe_dump(value).splitlines()[0]


def short_repr(value: Any, limit: int = 60) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer of more than 4,300 digits
        text = f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_validation_error(err: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    """The first pydantic error as ``field.path: message (got value)``; an unknown key names the nearest valid one."""
    e = err.errors()[0]
    loc = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
    msg = e["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
    if e["type"] == "extra_forbidden":
        allowed = _fields_at(model or RunConfig, e["loc"][:-1])
        near = difflib.get_close_matches(str(e["loc"][-1]), allowed, n=1, cutoff=0.6)
        msg = (f"unknown field; did you mean {near[0]!r}?" if near
               else f"unknown field; allowed: {', '.join(allowed)}" if allowed
               else "unknown field; this takes no parameters" if model is not None else "unknown field")
    elif e["type"] == "invalid_key":  # YAML 1.1 reads the keys off/on/yes/no (and numbers) as non-strings
        loc = ".".join(str(p) for p in (prefix, *e["loc"][:-1]) if p != "")
        hint = " (YAML reads off, on, yes and no as booleans: quote the key, e.g. 'off')" \
            if isinstance(e.get("input"), bool) else ""
        return f"{loc or 'config'}: the key {e.get('input')!r} is not text{hint}"
    elif e["type"] == "too_short" and e.get("ctx", {}).get("min_length") == 1:
        msg = "must not be empty (leave it out instead)"
    got = e.get("input")
    if isinstance(got, str) and _TEXT_FLOAT.fullmatch(got.strip()):
        msg += f"; YAML reads {got.strip()} as text, write {as_yaml_float(got.strip())}"
    shown = ("" if e["type"] in ("missing", "extra_forbidden", "too_short") or isinstance(got, dict) or "(got " in msg
             else f" (got {short_repr(got)})")
    if not loc and re.match(r"[a-z_]+(\.[a-z_]+)*: ", msg):  # a cross-field check names its own field
        return msg
    return f"{loc or 'config'}: {msg}{shown}"


def check_shape(raw: Any, where: str) -> None:
    """Refuse what no config needs and what would stall validation: deep nesting, YAML alias bombs (a few lines
    that expand to billions of values), and text that is not valid Unicode. Iterative, with early exits."""
    stack, seen = [(raw, 0)], 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_CONFIG_NODES:
            raise ConfigError(f"{where}: more than {MAX_CONFIG_NODES:,} values (YAML aliases expanded); not a config")
        if depth > 32:
            raise ConfigError(f"{where}: nested more than 32 levels deep; not a config")
        if isinstance(node, str):
            try:
                node.encode()
            except UnicodeEncodeError:
                raise ConfigError(f"{where}: a string is not valid Unicode text ({short_repr(node)})") from None
        elif isinstance(node, dict):
            stack.extend((x, depth + 1) for kv in node.items() for x in kv)
        elif isinstance(node, (list, tuple, set)):
            stack.extend((x, depth + 1) for x in node)


def validate(raw: dict, where: str = "config") -> RunConfig:
    check_shape(raw, where)
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    algorithms = registered()

    from .data.partition import parse_partition
    from .data.registry import get_spec

    parse_partition(cfg.data.partition, prefix="data.partition")
    try:
        get_spec(cfg.data.dataset)
    except ConfigError as e:
        raise ConfigError(f"data.dataset: {e}") from None
    from .models import check_name

    for i, arch in enumerate(cfg.model.heterogeneous or []):  # (options need the data's shape: checked at build)
        check_name(arch.name, f"model.heterogeneous.{i}.name")
    if not cfg.model.heterogeneous:
        check_name(cfg.model.name)
    checks = [("algorithm", cfg.algorithm)] + [(f"compare.{i}", a) for i, a in enumerate(cfg.compare or [])]
    for where_, a in checks:
        algo = algorithms.get(a.name)
        if algo is None:
            near = difflib.get_close_matches(a.name, list(algorithms), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            # a typo, or a plug-in's (recorded by the run, or one that did not import)
            plug = "" if near and not (plugins.RECORDED or plugins.BROKEN) else plugins.hint("algorithm")
            raise ConfigError(f"{where_}.name: unknown {short_repr(a.name)}{plug}; {hint}"
                              f"allowed: {', '.join(sorted(algorithms))}")
        try:
            algo.Config.model_validate(a.params())
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, where_, algo.Config)) from None
    # what runs: with compare its entries (RunConfig.variants), not the top-level algorithm
    running = [algorithms[a.name] for a in cfg.compare or [cfg.algorithm]]
    for algo in running:
        check_family(cfg, algo)
    return cfg


def trainable(cfg: RunConfig) -> int:
    """How many clients ever train: all but ``participation.held_out``'s (a scheme's own count: unknown here, so
    ``train.clients_per_round``)."""
    from .engine.seeding import held_out_count

    k = cfg.data.clients
    if k is None:
        return cfg.train.clients_per_round
    return k - held_out_count(k, cfg.participation.held_out if cfg.participation else 0.0)


def advise(cfg: RunConfig, compare_given: bool = False) -> None:
    """Warn about what a new run's config holds but will not use, and refuse an algorithm that would silently not
    run (not for the configs a run directory saved: a
    comparison's variant keeps the comparison's data.public although it alone never uses it). ``compare_given``:
    the compare list came from the command line (``--algorithms``), which replaces the algorithm knowingly."""
    running = [registered()[a.name] for a in cfg.compare or [cfg.algorithm]]
    if cfg.data.public is not None and not any(algo.uses_public for algo in running):
        names = ", ".join(sorted({repr(algo.name) for algo in running}))
        warnings.warn(f"data.public: no algorithm of this run uses a public stream ({names}); it is ignored",
                      stacklevel=2)
    if cfg.eval.report_every is not None:
        from .engine.evaluation import reports

        if not any(map(reports, running)):
            names = ", ".join(sorted({repr(algo.name) for algo in running}))
            warnings.warn(f"eval.report_every: no algorithm of this run reports measures of its own ({names}); it "
                          "is ignored", stacklevel=2)
        elif cfg.eval.report_every % cfg.eval.every == 0:
            warnings.warn(f"eval.report_every: {cfg.eval.report_every} is a multiple of eval.every "
                          f"({cfg.eval.every}): those rounds report with their evaluation anyway; it adds nothing",
                          stacklevel=2)
    if (k := cfg.train.clients_per_round) > (n := trainable(cfg)):
        warnings.warn(f"train.clients_per_round: {k}, but participation.held_out leaves {n} of the "
                      f"{cfg.data.clients} clients that train; each round samples those {n}", stacklevel=2)
    # the default section (which comparison.yaml files written before dump() left it out hold) says nothing
    if cfg.compare and not compare_given and cfg.algorithm != AlgorithmConfig() and cfg.algorithm not in cfg.compare:
        raise ConfigError(f"algorithm: {label(cfg.algorithm)} would not run: beside compare: only its entries run; "
                          "to run it alone add --set compare=null, to compare it add it to compare")


def check_family(cfg: RunConfig, algo) -> None:
    """The settings an algorithm (its class ``algo``) needs or cannot use, each refused in one line before anything
    is written — for every entry of a comparison before its first variant runs (so ``--check`` refuses them too)."""
    from .engine import robust

    name = algo.name
    # the robust stage, attack and privacy (the run's settings carry the same fields; the world checks them again)
    robust.check(cfg, algo, cfg.data.tasks is not None, min(cfg.train.clients_per_round, trainable(cfg)),
                 extra=False)
    if cfg.model.heterogeneous and (algo.global_model or algo.shares_weights):
        what = "one global model" if algo.global_model else "part of its clients' weights"
        raise ConfigError(f"model.heterogeneous: algorithm {name!r} averages {what}, so every client needs the same "
                          "architecture; use a model-heterogeneous algorithm (e.g. fedproto, local)")
    if cfg.train.warmup_epochs and algo.global_model:
        raise ConfigError(f"train.warmup_epochs: {name!r} trains one global model, there is no client model to warm "
                          "up; set it to 0")
    if algo.needs_warmup and not cfg.train.warmup_epochs:
        raise ConfigError(f"train.warmup_epochs: {name!r} distils from the model warmed up on the private data "
                          "(without it, a random model); set it to at least 1")
    if algo.uses_public and cfg.data.public is None:
        raise ConfigError(f"data.public: algorithm {name!r} trains on a public stream: set data.public "
                          "(e.g. {source: noise, size: 5000})")
    if algo.needs_tasks and cfg.data.tasks is None:
        raise ConfigError(f"data.tasks: algorithm {name!r} learns a stream of class-incremental tasks (without one it "
                          "is a plain federated method): set data.tasks (e.g. {n_tasks: 5, rounds_per_task: 10})")
    if cfg.eval.cross_clients and not algo.personalized:
        raise ConfigError(f"eval.cross_clients: {name!r} has no per-client models to cross-test; set it to false")
    if cfg.participation is not None and cfg.participation.held_out and cfg.data.tasks is not None:
        raise ConfigError("participation.held_out: held-out clients are evaluated on their own splits, which a "
                          "task stream's class-incremental evaluation does not use; drop one of the two")


def parse_value(text: str) -> Any:
    """A ``--set`` value read as YAML, so ``0.1``, ``true``, ``[1, 2]`` and ``{scheme: iid}`` get their types."""
    try:
        return yaml.load(text, _StrictLoader)  # (a SafeLoader)
    except _Refused as e:
        raise ConfigError(f"--set value {short_repr(text)}: {e}") from None
    except yaml.YAMLError:
        return text
    except RecursionError:
        raise ConfigError(f"--set value {short_repr(text)}: nested too deeply") from None
    except ValueError:  # Python refuses to read integers of more than 4,300 digits
        raise ConfigError(f"--set value {short_repr(text)}: a number too long to read") from None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for item in overrides:
        key, eq, value = item.partition("=")
        parts = [p.strip() for p in key.split(".")]
        if not eq or not all(parts):
            what = "expected key=value" if not eq else "empty key" if not key.strip() else "empty part in the key"
            raise ConfigError(f"--set {short_repr(item)}: {what}, e.g. train.rounds=5")
        node = raw
        for i, p in enumerate(parts[:-1]):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key.strip()}: {'.'.join(parts[: i + 1])} is not a section")
        node[parts[-1]] = parse_value(value)
    return raw


class _Refused(Exception):
    """YAML that PyYAML reads but a config must not (the message: what and where, without the file)."""


class _DuplicateKey(_Refused):
    def __init__(self, key, first: int, second: int):
        where = f"lines {first} and {second}" if first != second else f"line {first}"
        super().__init__(f"{short_repr(key)} is given twice ({where}); keep one")


class _StrictLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping: PyYAML keeps the last, so a second ``train:``
    would silently drop the first one's settings. (A key that overrides one merged in by ``<<:`` is no
    repeat.)"""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key: SafeLoader says so
                pass
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        """YAML 1.1's integers that read as other than they look: ``010`` is 8 (octal), ``1:00`` is 60 (base 60),
        ``0b11`` is 3 — refused, so ``seed: 010`` is not silently seed 8."""
        value = super().construct_yaml_int(node)
        body = str(node.value).replace("_", "").lstrip("+-")
        if ":" in body or body.startswith("0b") or (len(body) > 1 and body[0] == "0" and body[1:].isdigit()):
            kind = "a base-60" if ":" in body else "a binary" if body.startswith("0b") else "an octal"
            raise _Refused(f"{short_repr(node.value)} (line {node.start_mark.line + 1}) is {kind} number in "
                           f"YAML 1.1 ({value}); write the decimal number you mean, or quote it for a string")
        return value

    def construct_yaml_float(self, node):
        if ":" in str(node.value):  # (1:30.0 is 90.0)
            raise _Refused(f"{short_repr(node.value)} (line {node.start_mark.line + 1}) is a base-60 number in "
                           "YAML 1.1; write the decimal number you mean, or quote it for a string")
        return super().construct_yaml_float(node)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _StrictLoader.construct_yaml_float)


def read_yaml(path: Path) -> Any:
    """A YAML file's content; every way it can be unreadable is one line naming the file."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {size:,} bytes is too large for a config (at most {MAX_CONFIG_BYTES:,})")
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") from None
    try:
        return yaml.load(text, _StrictLoader)  # (a SafeLoader)
    except _Refused as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        raise ConfigError(f"{path}: invalid YAML" + (f" near line {line + 1}" if line is not None else "")) from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config") from None
    except ValueError:  # Python refuses to read integers of more than 4,300 digits
        raise ConfigError(f"{path}: holds a number too long to read") from None


def load_config(path: str | Path | None, overrides: list[str] = (), updates: dict | None = None) -> RunConfig:
    """The config in ``path`` (None: the defaults), with ``--set`` ``overrides`` and then top-level ``updates``."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found")
        raw = read_yaml(p)
        if raw is None:
            raise ConfigError(f"{p}: the file is empty (or only comments); a config needs at least one section")
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections (data, model, algorithm, train, ...)")
    raw = apply_overrides(raw, list(overrides))
    raw.update(updates or {})
    return validate(raw, str(path) if path is not None else "config")


def dump(cfg: RunConfig) -> str:
    """The resolved config as YAML; a comparison's without the top-level algorithm, which does not run."""
    return yaml.safe_dump(cfg.model_dump(mode="json", exclude={"algorithm"} if cfg.compare else None),
                          sort_keys=False)


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?inf|nan")


def _scalar(text: str):
    """A ``--algorithms`` value: an integer, a float, true/false, or else the text itself (for the schema to judge).
    Deliberately not YAML, which reads ``1:2`` as 62 and ``0x10`` as 16."""
    if re.fullmatch(r"[-+]?\d{1,18}", text):
        return int(text)
    if _NUMBER.fullmatch(text.lower()):
        return float(text)
    return {"true": True, "false": False}.get(text, text)


def algorithm_spec(text: str) -> dict:
    """``fedprox:mu=0.1,foo=2`` → ``{"name": "fedprox", "mu": 0.1, "foo": 2}`` (``--algorithms``, ``api.compare``)."""
    name, _, params = text.partition(":")
    spec: dict = {"name": name}
    for item in filter(None, params.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise FedMosaicError(f"--algorithms {text!r}: expected NAME[:KEY=VALUE,...], e.g. fedprox:mu=0.1")
        if key.strip() in spec:
            raise FedMosaicError(f"--algorithms {text!r}: {key.strip()!r} is given twice")
        spec[key.strip()] = _scalar(value.strip())
    return spec
