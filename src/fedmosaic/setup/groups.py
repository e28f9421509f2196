"""What a run is built from, before its first round: the architecture groups and their modules, each client's own
initial parameters, an algorithm's extra models, the public stream, and the partition spec of the data — each from
its own seed stream, so every driver that builds a run (in one process or on several) builds the same one."""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache

import numpy as np
import torch

from ..config import RunConfig
from ..data.federated import PartitionSpec
from ..data.public import public_images
from ..engine.client.compiled import CompileCache
from ..engine.client.execution import Execution
from ..engine.client.local import LocalTrainer
from ..engine.group import Group
from ..engine.mapping import for_each_client
from ..engine.seeding import INIT, PUBLIC, rng
from ..engine.tensors import ClientTensors
from ..errors import ConfigError
from ..models import build_model, construct, parameter_count
from ..protocol.tree import repeat, tmap
from .preflight import AUTOCAST, activation_bytes, check_fits, gib


def data_spec(cfg: RunConfig) -> PartitionSpec:
    d = cfg.data
    return PartitionSpec(d.dataset, d.clients, d.partition, d.pool, d.client_test, d.client_val,
                         cfg.seed if d.seed is None else d.seed, None if d.classes is None else tuple(d.classes))


def check_models_fit(cfg: RunConfig, shape: tuple, C: int, memory: int | None, dev: torch.device,
                     batch: int | None) -> None:
    """Refuse, before any model is built, an architecture whose training cannot fit even one client at a time: its
    parameters with their gradients, optimiser state and copies (9x) and the activations of one step of ``batch``
    samples, all measured on the meta device (nothing allocated). ``batch=None`` checks the parameters alone (what
    can be known before the data are laid out, which fixes the largest client and so the step's size)."""
    for spec in cfg.model.heterogeneous or [cfg.model]:
        with torch.device("meta"):
            ghost = construct(spec.name, shape, C, **spec.options)
        n = sum(t.numel() for t in [*ghost.parameters(), *ghost.buffers()])
        check_fits(4 * n, memory, dev, f"model {spec.name!r} ({n:,} parameters; model.options)")
        if batch is None:
            check_fits(4 * n * 9, memory, dev, f"training model {spec.name!r} ({n:,} parameters with their "
                       "gradients, optimiser state and copies, one client at a time; model.options)")
            continue
        acts = activation_bytes(ghost, shape, batch)
        check_fits(4 * n * 9 + acts, memory, dev,
                   f"training model {spec.name!r} ({n:,} parameters, {gib(acts)} of activations a step of {batch} "
                   "samples, one client at a time; model.options, train.batch_size)")


@lru_cache(maxsize=8)
def round_robin(shares: tuple[float, ...], num_clients: int) -> np.ndarray:
    """Per client its architecture, round-robin by share: client k gets the one whose quota is most behind (a
    Python loop over the clients, computed once per process: every runtime a wire pool builds asks again)."""
    owner = np.zeros(num_clients, dtype=np.int64)
    if len(shares) > 1:
        quota, given = np.array(shares) / sum(shares), np.zeros(len(shares))
        for k in range(num_clients):
            owner[k] = int(np.argmax(quota * (k + 1) - given))
            given[owner[k]] += 1
    owner.flags.writeable = False
    return owner


def build_groups(cfg: RunConfig, shape: tuple, C: int, num_clients: int, memory: int | None,
                 dev: torch.device) -> list[Group]:
    """One :class:`Group` per architecture (``model``, or ``model.heterogeneous`` with its shares or ``assign``),
    each module from the run's INIT seed stream; architectures no client got are left out."""
    m = cfg.model
    archs = m.heterogeneous or []
    gen = torch.Generator().manual_seed(int(rng(cfg.seed, INIT).integers(2**62)))
    specs = [(a.name, a.options, a.share) for a in archs] or [(m.name, m.options, 1.0)]
    owner = round_robin(tuple(float(s) for *_, s in specs), num_clients)
    if m.assign is not None:  # an explicit architecture per client
        if len(m.assign) != num_clients:
            raise ConfigError(f"model.assign: one architecture index per client, {num_clients} clients "
                              f"(got {len(m.assign)})")
        owner = np.asarray(m.assign, dtype=np.int64)
    groups = []
    for gid, (name, options, _) in enumerate(specs):
        n = parameter_count(name, shape, C, **options)
        check_fits(4 * n, memory, dev, f"model {name!r} ({n:,} parameters; model.options)")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
            module = build_model(name, shape, C, **options).to(dev)
        groups.append(Group(gid, module, np.flatnonzero(owner == gid)))
    return [g for g in groups if len(g.clients)]


def client_inits(cfg: RunConfig, g: Group, shape: tuple, C: int, dev: torch.device) -> dict:
    """Per client of ``g`` its own initial parameters (stacked), each from the seed stream (INIT, 2, client)."""
    m = cfg.model
    spec = (m.heterogeneous or [])[g.gid] if m.heterogeneous else m
    out = []
    for k in g.clients:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(rng(cfg.seed, INIT, 2, int(k)).integers(2**62)))
            module = build_model(spec.name, shape, C, **spec.options).to(dev)
        out.append({n: p.detach() for n, p in module.named_parameters()})
    return tmap(lambda *ts: torch.stack(ts), *out)


def client_store(cfg: RunConfig, algo, g: Group, one: dict, shape: tuple, C: int, dev: torch.device) -> dict:
    """The initial state of every client of ``g``, stacked: ``one`` (``init_client`` of the group's initial
    parameters) for each, or with ``model.init: own`` each client's of its own initial parameters."""
    m = cfg.model
    if m.init == "own" or (m.init == "auto" and m.heterogeneous is not None):
        return for_each_client(algo.init_client, (0,), False)(client_inits(cfg, g, shape, C, dev))
    return repeat(one, len(g.clients))


def make_trainer(cfg: RunConfig, algo, module: torch.nn.Module, ex: Execution, transform, pad_fill, batch: int,
                 extra: dict, public: ClientTensors | None, key: str | None = None) -> LocalTrainer:
    """The local trainer of one architecture, run as ``ex`` says; a compiled one keeps its graphs in the compile
    cache under ``key`` (:func:`compile_key`)."""
    trainer = LocalTrainer(algo, module, cfg.train.optimizer, cfg.model.task_loss, transform,
                           ex.backend == "vectorized", cfg.engine.chunk_size, ex.compile, ex.fuse_steps,
                           cfg.data.augment, pad_fill, cfg.train.local_epochs, batch, loop_below=ex.loop_below,
                           threads=ex.threads, channels_last=ex.channels_last, extra=extra,
                           compile_cache=(CompileCache.default(), key) if ex.compile and key else None)
    trainer.public = public
    trainer.autocast = AUTOCAST[cfg.engine.precision]
    return trainer


def compile_key(cfg: RunConfig, module: torch.nn.Module, shape: tuple, batch: int, device: torch.device) -> str:
    """What a compiled setting's graphs depend on, hashed: torch's version, the device, the architecture (its class and
    printed structure), the input shape and batch, the algorithm and its options (its objective is in the graph),
    the optimiser, loss, augmentation, precision, chunk and fused steps. Only a hint to ``execution.choose`` (which
    warm-up to expect): torch's own cache keys decide what is reused."""
    parts = [torch.__version__, device.type, type(module).__qualname__, str(module), list(shape), batch,
             cfg.algorithm.model_dump(mode="json"), cfg.train.optimizer.model_dump(mode="json"), cfg.model.task_loss,
             cfg.data.augment.model_dump(mode="json"), cfg.engine.precision, cfg.engine.chunk_size,
             cfg.engine.fuse_steps, min(cfg.engine.chunk_size, cfg.train.clients_per_round)]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def build_public(cfg: RunConfig, shape: tuple, pixels: bool, normalize, dev: torch.device) -> ClientTensors | None:
    """The shared public stream (``data.public``): noise uniform in [0, 1) of the private input shape (in the
    raw value range of the data: x255 for uint8 images, so normalisation treats it like pixels), or a dataset's
    train images resized to the private image size and channels; normalised like the private data. ``pixels``:
    the private data are uint8 images."""
    pc = cfg.data.public
    if pc is None:
        return None
    seed = cfg.seed if pc.seed is None else pc.seed
    gen = rng(seed, PUBLIC)
    if pc.source == "noise":
        x = gen.random((pc.size, *shape), dtype=np.float32)
        if pixels:
            x *= 255
    else:
        x = public_images(pc.source, pc.size, shape, gen)
    t = torch.as_tensor(x, device=dev)
    t = normalize.all(t) if normalize is not None else t
    return ClientTensors(t, torch.arange(len(t), device=dev), np.array([0, len(t)]))


def build_extra(cfg: RunConfig, specs: dict, groups: int, shape: tuple, C: int, num_clients: int,
                memory: int | None, dev: torch.device) -> dict:
    """The modules of the slots an algorithm trains with architectures of their own (FedKD's mentor), built
    from their own seed stream: one per slot, shared by every client (each client's parameters are its own)."""
    if not specs:
        return {}
    if groups > 1:
        raise ConfigError(f"algorithm {cfg.algorithm.name!r}: its extra models need one architecture per "
                          "run (model.heterogeneous is set)")
    out = {}
    for i, (slot, (name, options)) in enumerate(specs.items()):
        n = parameter_count(name, shape, C, **options)
        check_fits(4 * n * (1 + num_clients), memory, dev,
                   f"the {slot} model {name!r} of every client ({n:,} parameters each)")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(rng(cfg.seed, INIT, 1 + i).integers(2**62)))
            module = build_model(name, shape, C, **options).to(dev)
        if any(True for _ in module.buffers()):
            raise ConfigError(f"the {slot} model {name!r} has buffers (BatchNorm): not supported for an extra "
                              "model; choose one without (e.g. GroupNorm)")
        out[slot] = module
    return out
