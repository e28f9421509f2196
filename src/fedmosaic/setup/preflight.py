"""The checks a run passes before anything is allocated or written: the device and the memory it has, and every
request that could not fit or could not work (a batch plan of 10^9 steps, a model of 10^9 parameters, a slot name
that local_init does not return, a cross-client matrix of 10^6 pairs, a memory budget that keeps nothing) — each
refused in one line that names the setting, not an out-of-memory error or a KeyError in round 0."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch

from ..config import RunConfig
from ..errors import ConfigError
from ..protocol.algorithm import Algorithm
from ..protocol.program import Phase, View
from ..protocol.tree import nbytes, tmap

#: ``FEDMOSAIC_DEVICE=cpu|cuda|cuda:1|mps``: the device ``engine.device: auto`` means in this environment (a GPU
#: machine's test suite on the CPU, or on CUDA: tests/conftest.py's ``FEDMOSAIC_TEST_DEVICE``)
DEVICE_ENV = "FEDMOSAIC_DEVICE"


def resolve_device(name: str) -> torch.device:
    """``auto``: ``$FEDMOSAIC_DEVICE`` if set, else the first CUDA device when there is one, else the CPU. A device
    that is not there is an error."""
    where = "engine.device"
    if name == "auto":
        name, where = os.environ.get(DEVICE_ENV, "").strip(), f"${DEVICE_ENV}"
        if not name:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{where}: {name!r} is not a device to train on (use 'cpu', 'cuda', 'cuda:1' or 'mps')")
    if dev.type == "cuda":
        there = torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()
    else:
        there = dev.type != "mps" or torch.backends.mps.is_available()
    if not there:
        raise ConfigError(f"{where}: {name!r} is not available on this machine (use 'auto' or 'cpu')")
    return dev


def precision(deterministic: bool, tf32: bool, device: torch.device) -> None:
    """The precision and determinism policy of a run on ``device`` (``engine.deterministic``, ``engine.tf32``):
    on CUDA, TensorFloat-32 as configured (torch's own defaults differ between matrix products and convolutions)
    and, when deterministic, only deterministic kernels — cuBLAS's fixed workspace, cuDNN's deterministic
    algorithms, no autotuning. A CPU run is left as it is: its kernels are deterministic."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS makes its first handle
    # warn_only: an op with no deterministic CUDA kernel (none of ours is left: see docs/design.md "GPU") says so
    # in a warning naming it, rather than stopping a run that has only lost bit-exactness
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = deterministic, not deterministic


def denormals(mode: str) -> None:
    """``engine.denormals: flush``: subnormal floats flushed to zero on the CPU, or one line where the CPU has no
    such flags. The flags are per thread: set on the calling one and inherited by the threads started later, not
    by those of a pool torch already runs (in a process that ran something before this run), so a product spread
    over every intra-op thread checks that they all flush, and a warning says so where some do not. ``keep``
    changes nothing — a library does not reset a floating-point mode its user did not ask it to — and warns where
    the process already flushes (an earlier run's ``flush``, which no call can take back from torch's threads)."""
    if mode == "flush" and not torch.set_flush_denormal(True):
        raise ConfigError("engine.denormals: flush: this CPU has no flush-to-zero flags (x86 FTZ/DAZ); use keep")
    flushed = int(_subnormal_products().eq(0).sum())
    threads = torch.get_num_threads()
    if mode == "flush" and flushed < _SUBNORMAL_CHECK * threads:
        warnings.warn(f"engine.denormals: flush reached only some of torch's {threads} threads (their pool was "
                      "started before this run): which numbers flush depends on how work is split; run it in a "
                      "fresh process", stacklevel=3)
    elif mode == "keep" and flushed:
        warnings.warn("engine.denormals: keep, but this process already computes subnormal floats as zero (an "
                      "earlier run's flush, or its user); run it in a fresh process for IEEE underflow", stacklevel=3)


#: elements of the subnormal check per intra-op thread: two of at::parallel_for's grains (32,768), so that every
#: thread of the pool computes a share
_SUBNORMAL_CHECK = 65536


def _subnormal_products() -> torch.Tensor:
    """1e-20 x 1e-20 (= 1e-40, a subnormal) computed by every intra-op thread: zeros where a thread flushes."""
    return torch.full((_SUBNORMAL_CHECK * torch.get_num_threads(),), 1e-20) * 1e-20


#: ``engine.precision`` -> the dtype the forward passes autocast to (None: none, float32)
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _bf16_units(device: torch.device) -> bool:
    """Whether the GPU computes bfloat16 natively (Ampere, compute capability 8, or later), not by emulation."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def check_precision(precision: str, device: torch.device) -> None:
    """``engine.precision`` where ``device`` can do it, else one line."""
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"engine.precision: 'fp16' runs on CUDA GPUs only, not on {device.type!r} (use 'bf16' "
                          "where the CPU has bfloat16 units, else 'fp32')")
    if precision == "bf16" and device.type == "cuda" and not _bf16_units(device):
        raise ConfigError(f"engine.precision: 'bf16' needs a GPU with bfloat16 units (Ampere or later); "
                          f"{torch.cuda.get_device_name(device)} has none (use 'fp32')")
    if precision == "bf16" and device.type == "mps":
        raise ConfigError("engine.precision: 'bf16' is not supported on 'mps' here (use 'fp32')")


def memory_bytes(device: torch.device) -> int | None:
    """The memory a run on ``device`` can use at most: the GPU's free memory now (what other processes and this
    run's data, already there, leave), or the machine's (or its cgroup's limit)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    try:
        return min(total, int(Path("/sys/fs/cgroup/memory.max").read_text()))  # cgroup v2; "max" = no limit
    except (OSError, ValueError):
        return total


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_fits(need: int, budget: int | None, device: torch.device, what: str) -> None:
    """Requests that cannot fit are refused up front, in one line, before an allocator fails (or the OOM killer
    strikes a lazily committed allocation)."""
    if budget is not None and need > budget:
        raise ConfigError(f"{what} needs about {gib(need)}, more than the {gib(budget)} of memory on {device}")


def check_slots(algo, server: dict, state: dict, clients: np.ndarray) -> None:
    """The slot names an algorithm's terms, program steps and probes use must be trees ``local_init`` returns:
    a misspelt name is one line before the first round, not a KeyError deep inside a mapped function."""
    ids = torch.as_tensor(clients)
    own = {**tmap(lambda t: t[0], algo.client_payload(server, ids)), "cid": ids[0]}
    sent = algo.broadcast(server, 0)
    slots = set(algo.local_init({**sent, "own": own}, state))
    terms = algo.terms() if type(algo).loss is Algorithm.loss else []  # an own ``loss`` need not use terms
    used = [(f"term {type(t).__name__}", s) for t in terms if hasattr(t, "slot")
            for s in ((t.slot,) if isinstance(t.slot, str) else t.slot)]
    for phase in [*algo.program(0), *(algo.finetune() or [])]:
        used += [("program step", s) for u in phase.updates for s in (u.slots or ())]
    used += [(f"probe {p.name!r}", s) for p in algo.probes(0, sent) for s in (p.slots or ())]
    for what, slot in used:
        if slot not in slots:
            raise ConfigError(f"algorithm {algo.name!r}: {what} uses slot {slot!r}, but local_init returns only "
                              f"{sorted(slots)}")


def check_plans(cfg: RunConfig, algo: Algorithm, server: dict, clients: int, chunk: int, batch: int, largest: int,
                public: int | None, memory: int | None, device: torch.device) -> None:
    """The batch plan of every phase a client or the server runs — per client, step and slot an index (numpy
    and torch), a mask, augmentation — fits in memory: a step or epoch count no machine can run (10^9 local or
    warm-up epochs, an algorithm's 2^31-1 steps) is refused up front, not an out-of-memory error in round 0.
    ``clients``: the federation's; ``chunk``: clients trained at once; ``largest``: the largest client's train
    samples; ``public``: the public stream's size (None: none)."""
    tc = cfg.train
    every = min(cfg.engine.chunk_size, clients)  # warm-up and fine-tuning: every client, chunk by chunk
    program = algo.program(0)
    plans = [(ph, chunk, f" of phase {i + 1} of the round" if len(program) > 1 else "", None)
             for i, ph in enumerate(program)]
    plans += [(ph, every, " of the fine-tuning", None) for ph in algo.finetune() or ()]
    plans += [(ph, 1, " of the server's training", None) for ph in algo.server_program(server, 0) or ()]
    if tc.warmup_epochs:
        plans.append((Phase(epochs=tc.warmup_epochs), every, " of the warm-up", "train.warmup_epochs"))
    for ph, n, what, knob in plans:
        on_public = ph.view.part == "public"
        size = public if on_public and public is not None else largest
        b = ph.batch or batch
        width = 2 * b if ph.pair is not None else b  # slots per step: a paired batch doubles them
        # View("next") cuts both halves from the phase's own shuffle: an epoch is then ceil(n / 2B) steps
        steps = ph.steps or (ph.epochs or tc.local_epochs) * -(-size // (width if ph.pair == View("next") else b))
        per_slot = 8 + 1 + 8 + 4 + (40 if cfg.data.augment.active and not on_public else 0)
        knob = knob or (option_of(algo, ph.steps, "its step count") if ph.steps is not None
                        else "train.local_epochs" if ph.epochs is None
                        else option_of(algo, ph.epochs, "its epoch count"))
        check_fits(n * steps * width * per_slot, memory, device,
                   f"the local batch plan{what} ({n} clients x {steps:,} steps x batch {width}; {knob}, "
                   "train.batch_size, engine.chunk_size)")


def option_of(algo: Algorithm, value: int, otherwise: str) -> str:
    """The algorithm option(s) holding a phase's step or epoch count ``value`` (e.g. ``algorithm.w_steps``)."""
    names = [f"algorithm.{k}" for k, v in algo.cfg if type(v) is int and v == value]
    return " or ".join(names) or otherwise


#: activation_bytes's answers of this process, by key (the check of the model and the group's module ask twice)
_ACTIVATIONS: dict[str, int] = {}


def activation_bytes(module: torch.nn.Module, input_shape: tuple, batch: int) -> int:
    """What autograd keeps for the backward pass of one client's local step on ``batch`` samples: every tensor the
    forward pass and the loss save, but the parameters themselves. Measured on the ``meta`` device (shapes only:
    no memory touched, no arithmetic done), so a model's allowance costs nothing to know, on any machine.

    The measurement's meta kernels import torch's compiler stack (~1.5 s of CPU), which every process that builds a
    run would pay again — each message of a deployed node is one — so answers are kept under the cache folder
    (``activations/``), keyed by everything they depend on: the torch version, the module's class, its printed
    structure, its parameters' and buffers' names, shapes and dtypes, the input shape and the batch. An entry that
    cannot be read is measured again."""
    import hashlib
    import json

    from ..paths import default_cache_dir

    tensors = [(k, tuple(v.shape), str(v.dtype)) for k, v in [*module.named_parameters(), *module.named_buffers()]]
    key = hashlib.sha256(json.dumps([1, torch.__version__, type(module).__module__, type(module).__qualname__,
                                     repr(module), tensors, list(input_shape), batch]).encode()).hexdigest()
    if key in _ACTIVATIONS:
        return _ACTIVATIONS[key]
    path = default_cache_dir() / "activations" / f"{key[:32]}.json"
    try:
        entry = json.loads(path.read_text())
        if entry["key"] == key and type(entry["bytes"]) is int and entry["bytes"] >= 0:
            _ACTIVATIONS[key] = entry["bytes"]
            return entry["bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not measured yet, or a damaged entry: measure
    saved = _measure_activations(module, input_shape, batch)
    if saved is not None:
        _ACTIVATIONS[key] = saved
        try:
            from ..files import atomic_write

            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps({"key": key, "bytes": saved}).encode())
        except OSError:
            pass  # an unwritable cache must not stop a run
    return saved or 0


def _measure_activations(module: torch.nn.Module, input_shape: tuple, batch: int) -> int | None:
    """:func:`activation_bytes` measured (None: not measurable)."""
    meta = torch.device("meta")
    params = {k: torch.empty_like(v, device=meta).requires_grad_(v.is_floating_point())
              for k, v in module.named_parameters()}
    held = {id(v) for v in params.values()}
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if id(t) not in held and id(t._base) not in held:
            saved += t.numel() * t.element_size()
        return t

    x = torch.empty((batch, *input_shape), device=meta)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = torch.func.functional_call(
                module, {**params, **{k: torch.empty_like(v, device=meta) for k, v in module.named_buffers()}}, (x,))
            torch.nn.functional.cross_entropy(out, torch.zeros(batch, dtype=torch.int64, device=meta))
    except Exception as e:  # a model that reads its data on the host (``.item()``), or a custom kernel: unknown
        warnings.warn(f"the activations of {module.__class__.__name__} cannot be measured without data "
                      f"({type(e).__name__}: {str(e).strip()[:120]}); the memory check counts none", stacklevel=4)
        return None
    return saved


def check_training_memory(module: torch.nn.Module, init: dict, clients: int, state_bytes: int, chunk: int,
                          memory: int | None, device: torch.device, activations: int = 0) -> None:
    """Every client's persistent state, plus the cohort chunk's parameters, gradients and optimiser state, and the
    ``activations`` one client's step keeps for its backward pass (:func:`activation_bytes`) times the ``chunk`` of
    clients trained at once."""
    params = nbytes(init)
    need = state_bytes * clients + params * (4 + 5 * chunk) + activations * chunk
    check_fits(need, memory, device,
               f"training {module.__class__.__name__} ({params // 4:,} parameters, {gib(activations)} of activations "
               f"per client and step; {clients} client states, {chunk} clients trained at once: engine.chunk_size, "
               "train.clients_per_round, train.batch_size)")


def check_evaluation(cfg: RunConfig, personalized: bool, clients: int, tested: bool) -> None:
    """What the per-client evaluation can only be checked against once the partition is known (the family's
    config-only settings: ``config.check_family``). ``tested``: the clients have test splits."""
    if cfg.eval.cross_clients and not tested:
        raise ConfigError("eval.cross_clients: the clients have no test splits to cross-test on; set "
                          "data.client_test (e.g. 0.25)")
    if cfg.eval.cross_clients and clients < 2:
        raise ConfigError("eval.cross_clients: one client has no other client's split to be tested on; it needs at "
                          "least 2 clients")
    if cfg.eval.cross_clients and clients > 256:
        raise ConfigError(f"eval.cross_clients: {clients} clients would test "
                          f"{clients ** 2:,} model/split pairs every evaluation; at most 256 clients")
    if cfg.eval.client_test and personalized and not tested:
        warnings.warn(f"data.client_test: {cfg.algorithm.name!r} is personalized, but the clients have no test "
                      "splits: no personal accuracy is measured; set data.client_test (e.g. 0.25)", stacklevel=3)


def check_memory_total(total: int, at: str, per_task: int, longest: int) -> None:
    """A total memory budget is shared equally by the classes a client has met (``memory.per_class_budget``),
    rounded down: below one sample per class the memory is empty, replay silently off."""
    if total < per_task:
        raise ConfigError(f"{at}: {total} shared by the {per_task} classes of a task keeps 0 samples of each: "
                          f"the memory would stay empty; set at least {per_task} (or use per_class)")
    full = total // per_task  # the tasks after which a client that met all their classes still keeps some
    if full < longest - 1:
        warnings.warn(f"{at}: {total} shared by the classes met keeps 0 samples of each once more than "
                      f"{full * per_task} are met: the memory is empty from task {full + 2} of {longest} on; "
                      f"{(longest - 1) * per_task} would keep one of each to the last task", stacklevel=4)
