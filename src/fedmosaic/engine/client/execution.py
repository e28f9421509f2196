"""How a run executes — chosen per model, device and run length when the config leaves it to fedmosaic.

``engine.backend: auto`` and ``engine.compile: auto`` (the defaults) are resolved once per architecture group, before
the first round, by :func:`choose`: a pure function of what the run is (the model, the device, the estimated step
profile of its cohorts, whether the round program is the plain one the compiled path runs). Explicit settings are
overrides and are kept as they are. Every execution gives the same numbers (within float tolerance); only the time
differs. The rule and the measurements behind its constants: docs/benchmarks.md ("How fedmosaic chooses").

- Convolutional models on the CPU train on the per-client loop (``sequential``): ``vmap`` over per-client conv
  weights becomes grouped convolutions, which the CPU runs slower than one plain convolution per client. Their
  image batches go in channels-last memory order, which the CPU's convolution kernels run faster.
- Other models (and any model on a GPU) are vectorized, and a step with few active clients — the long tail of a
  power-law cohort, where one large client runs on alone — is looped: a vmapped step costs a fixed framework
  overhead worth several plain single-client steps (``loop_below``).
- Dense models with tiny steps (parameters x batch <= ``TINY_STEP``) train on one CPU thread: their operations
  are too small to gain from several, and the threads' fork/join costs more than it saves.
- ``torch.compile`` only where the estimated time it saves over the whole run is at least its one-time warm-up
  (the cold one, or the warm one when the setting's graphs are in the compile cache) and a compiler for the device
  is there. Every update's gradient function is compiled; runs of steps of the default phase (the plain program)
  are also fused into one compiled call each.

The process's CPU threads are chosen in ``threads.py`` (:func:`~.threads.cpu_threads`).
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from .looped import draws_random

if TYPE_CHECKING:
    from .threads import Threads

#: Per lockstep step of a small model, in milliseconds, measured on the benchmark CPU (docs/benchmarks.md): the
#: eager vmapped step (logistic regression, B = 10: 0.49 ms with one active client, 0.70 with eight), one looped
#: client's step (0.10-0.11 ms), and a compiled fused step.
VMAP_STEP_MS = {"cpu": 0.70, "cuda": 0.85}
LOOP_CLIENT_MS = {"cpu": 0.10, "cuda": 0.20}
COMPILED_STEP_MS = {"cpu": 0.08, "cuda": 0.10}
#: The one-time cost of compiling a run's shapes (several power-of-two cohort buckets, plain and fused), seconds,
#: cold (nothing in the compile cache) and warm (this setting compiled here before: ``compiled.CompileCache``):
#: measured on the benchmark CPU ~126 s and ~38 s for the APFL-MNIST FedAvg run (docs/benchmarks.md); the GPU's
#: are assumed alike (not measured yet).
COMPILE_WARMUP_S = {"cpu": {"cold": 120.0, "warm": 40.0}, "cuda": {"cold": 120.0, "warm": 40.0}}
#: Compile only when the estimated saving is at least this many warm-ups.
COMPILE_MARGIN = 1.0
#: On a GPU only single-client steps are looped (a kernel launch per client and op costs more than vmap's batching).
GPU_LOOP_BELOW = 2
#: A dense model whose parameters x batch size is at most this takes steps too small to gain from several CPU
#: threads (their fork/join costs more): it trains on one (evaluation keeps torch's default).
TINY_STEP = 2**20


@dataclass(frozen=True)
class ModelFacts:
    """What of a model matters for how to run it."""

    name: str
    params: int
    conv: bool  # has convolutions
    buffers: bool  # has buffers (BatchNorm running statistics): vmap cannot update them per client
    random: bool = False  # has dropout layers: vmap cannot draw their masks per client; the loop seeds them

    @classmethod
    def of(cls, module: torch.nn.Module) -> ModelFacts:
        conv = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in module.modules())
        return cls(module.__class__.__name__, sum(p.numel() for p in module.parameters()), conv,
                   any(True for _ in module.buffers()), draws_random(module))



@dataclass(frozen=True)
class RunFacts:
    """The run's shape: ``rounds``, and per round on average ``active[a]`` = the number of lockstep steps during
    which exactly ``a`` clients of a chunk are active (index 0 unused), from the cohorts the run will draw."""

    rounds: int
    active: tuple[float, ...] = ()
    plain: bool = True  # the round program is the default phase (what the compiled fused path runs)
    batch: int = 1
    updates: float = 1.0  # gradient updates per lockstep step, on average over the program (pFedMe's: K + 1)

    @property
    def lockstep_steps(self) -> float:
        """Steps per round in lockstep (the sum over chunks of their largest client's steps)."""
        return float(sum(self.active))

    @property
    def client_steps(self) -> float:
        """Client steps per round (what a plain per-client loop runs)."""
        return float(sum(a * n for a, n in enumerate(self.active)))


def step_profile(steps: np.ndarray, cohorts: list[np.ndarray], chunk: int) -> tuple[float, ...]:
    """``RunFacts.active`` from the clients' step counts and a sample of the run's cohorts (trained in chunks of
    ``chunk`` clients, each chunk in lockstep until its largest client is done)."""
    width = min(chunk, max((len(c) for c in cohorts), default=0))
    total = np.zeros(width + 1)
    for cohort in cohorts:
        for lo in range(0, len(cohort), chunk):
            s = np.sort(steps[cohort[lo : lo + chunk]])[::-1]  # s[a-1]: steps while at least a clients are active
            if len(s):
                total[1 : len(s) + 1] += s - np.append(s[1:], 0)
    return tuple((total / max(len(cohorts), 1)).tolist())


@dataclass(frozen=True)
class Execution:
    backend: str  # "vectorized" | "sequential"
    compile: bool
    fuse_steps: int
    loop_below: int  # vectorized: steps with fewer active clients than this run on the per-client loop
    why: str = ""
    auto: tuple[str, ...] = field(default=())  # which settings were chosen automatically
    threads: int | None = None  # CPU threads while training (None: the process's, ``cpu_threads``)
    channels_last: bool = False  # looped steps feed image batches to the model in channels-last memory order
    cpu_threads: Threads | None = None  # the process's CPU threads (set by the federation, recorded in meta.json)
    #: ``compile: auto`` counted on the short warm-up (the setting's graphs were in the compile cache); recorded in
    #: meta.json, so a resume, a Ray actor and the driver decide alike whatever their caches hold
    warm: bool = False

    @property
    def label(self) -> str:
        if self.backend == "sequential":
            return "sequential, channels-last inputs" if self.channels_last else "sequential"
        parts = ["vectorized"]
        if self.compile:
            parts.append(f"compile (fused x{self.fuse_steps})" if self.fuse_steps > 1 else "compile")
        text = "+".join(parts)
        if not self.compile:  # (the compiled path pads its cohorts to a few shapes and never loops)
            if self.loop_below > 2:
                text += f", steps of < {self.loop_below} active clients looped"
            elif self.loop_below == 2:
                text += ", single-client steps looped"
        if self.threads is not None:
            text += f", {self.threads} thread{'s' if self.threads > 1 else ''} while training"
        return text

    def describe(self) -> str:
        how = f"auto: {self.why}" if self.auto else "as configured"
        return f"{self.label} ({how})"

    def as_dict(self) -> dict:
        return {"backend": self.backend, "compile": self.compile, "fuse_steps": self.fuse_steps,
                "loop_below": self.loop_below, "threads": self.threads, "channels_last": self.channels_last,
                "chosen": list(self.auto), "why": self.why, "label": self.label, "compile_warm": self.warm,
                **({"cpu_threads": self.cpu_threads.count, "cpu_threads_why": self.cpu_threads.why}
                   if self.cpu_threads else {})}


def compiler_available(device: str) -> bool:
    """Whether torch.compile's inductor can build kernels here: for CUDA, torch's own test (``has_triton``: Triton
    installed and a GPU of compute capability 7 or more) and a C compiler (Triton builds its launcher with one);
    for the CPU, a C++ compiler. A compile that fails anyway falls back to eager (``local.CompiledOrEager``)."""
    if device == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # an older torch
            return False
        return has_triton() and any(shutil.which(c) for c in ("cc", "gcc", "clang"))
    if device == "cpu":
        return any(shutil.which(c) for c in ("g++", "c++", "clang++"))
    return False


def loop_below_for(device: str) -> int:
    """On the vectorized path: loop the steps with fewer active clients than this (see module docstring)."""
    if device == "cpu":
        return int(np.ceil(VMAP_STEP_MS["cpu"] / LOOP_CLIENT_MS["cpu"]))
    return GPU_LOOP_BELOW


def eager_step_ms(device: str, a: int, loop_below: int) -> float:
    """The framework overhead of one eager lockstep step with ``a`` active clients."""
    dev = device if device in VMAP_STEP_MS else "cuda"
    return LOOP_CLIENT_MS[dev] * a if a < loop_below else VMAP_STEP_MS[dev]


def compile_saving_s(run: RunFacts, device: str, loop_below: int) -> float:
    """The estimated time compiling saves over the whole run (overhead only: the arithmetic stays)."""
    dev = device if device in COMPILED_STEP_MS else "cuda"
    per_round = sum(n * max(0.0, eager_step_ms(dev, a, loop_below) - COMPILED_STEP_MS[dev])
                    for a, n in enumerate(run.active) if a)
    return run.rounds * per_round * run.updates / 1000


def choose(backend: str, compile: bool | str, fuse_steps: int, model: ModelFacts, device: str, run: RunFacts,
           compiler: bool | None = None, threads: int | None = None, warm: bool = False) -> Execution:
    """The execution of one architecture group. ``backend``/``compile`` as configured (``auto`` or explicit);
    ``device``: ``cpu``, ``cuda`` or ``mps``; ``compiler``: whether torch.compile can work here (None: look);
    ``threads``: ``engine.threads`` (set: kept); ``warm``: this setting was compiled here before (its graphs are in
    the compile cache: the short warm-up)."""
    auto_backend = backend == "auto"
    chosen: list[str] = []
    kind = "convolutional" if model.conv else "dense"
    why = [device, f"{kind} model of {model.params:,} parameters",
           f"{run.rounds:,} rounds x ~{run.lockstep_steps:,.0f} lockstep steps (~{run.client_steps:,.0f} client steps)"]
    if model.buffers or model.random:  # running statistics updated in place, or dropout's random draws: neither
        # can be made per client under vmap
        if backend != "sequential":
            why.append("model buffers (BatchNorm statistics) need the per-client loop" if model.buffers else
                       "dropout draws its masks per client on the per-client loop")
        if backend == "auto":
            chosen.append("backend")
        backend = "sequential"
    if backend == "auto":
        chosen.append("backend")
        if compile is True:
            backend = "vectorized"  # compiling needs the mapped step
        elif model.conv and device != "cuda":
            backend = "sequential"
            why.append("vmap over convolutions is slower than a per-client loop here")
        else:
            backend = "vectorized"
        loop_below = 0 if backend == "sequential" else loop_below_for(device)
    else:
        loop_below = 0  # an explicit ``vectorized`` is pure vmap
    if compile == "auto":
        compile = False
        if backend == "vectorized":  # (the sequential path has nothing to compile)
            chosen.append("compile")
            dev = device if device in COMPILE_WARMUP_S else "cuda"
            state = "warm" if warm else "cold"
            saving, warmup = compile_saving_s(run, dev, loop_below), COMPILE_WARMUP_S[dev][state]
            if saving < COMPILE_MARGIN * warmup:
                why.append(f"no compile: it would save ~{saving:,.0f} s, the {state} warm-up costs ~{warmup:.0f} s")
            elif not (compiler if compiler is not None else compiler_available(device)):
                why.append(f"no compile: no compiler for {device} found")
            else:
                compile = True
                why.append(f"compile: saves ~{saving:,.0f} s for ~{warmup:.0f} s of {state} warm-up")
    if compile is True and backend != "vectorized":  # (explicit: said, not dropped in silence)
        dropped = "no compile: " + ("the model's buffers or dropout need the per-client loop, which has nothing to "
                                    "compile" if model.buffers or model.random else "the per-client loop "
                                    "(engine.backend: sequential) has nothing to compile")
        why.append(dropped)
        warnings.warn(f"engine.compile: true, but {dropped}", stacklevel=2)
    compile = bool(compile) and backend == "vectorized"
    train_threads = None
    if auto_backend and threads is None and device == "cpu" and not model.conv and not compile \
            and model.params * run.batch <= TINY_STEP:
        train_threads = 1
        why.append(f"steps of {model.params:,} parameters x batch {run.batch}: one thread")
    # the CPU's convolutions run faster on channels-last inputs (oneDNN); chosen with the loop, never imposed
    channels_last = auto_backend and backend == "sequential" and model.conv and device == "cpu"
    if channels_last:
        why.append("channels-last inputs")
    # fused blocks are of the default phase's steps: a program of other phases runs each step compiled alone
    return Execution(backend, compile, fuse_steps if compile and run.plain else 1, loop_below, "; ".join(why),
                     tuple(chosen), train_threads, channels_last, warm=warm)
