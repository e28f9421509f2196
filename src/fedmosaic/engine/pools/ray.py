"""A client pool on Ray actors (``engine.pool: ray``): a simulation scaled out over processes and machines.

Each actor hosts a runtime (``client.runtime.ClientRuntime``) of a contiguous shard of the client ids — their data
rows, states and exemplar memory, nothing of the other clients — built in the actor as the wire pool builds its
runtimes (``setup.world.World.client_runtime``: the same modules, seeds and trainers, the execution chosen for the
actor's device).
The driver keeps the server side. A round's broadcast goes into the object store once and every actor reads it
from there; each actor is sent only its clients' rows of the assignment; the answers come back and are put in
(architecture, client id) order (``messages.order_parts``) before the server's unchanged ``aggregate``, so every sum
runs in the order it runs in one process. A checkpoint gathers the clients' state by client id, so a run resumes
on any number of actors, or in one process.

An actor that dies (its process killed, its node gone) raises :class:`ClientsLost`; the runner then replays the run
from its last checkpoint on new actors (``runs.runner.run``), and the run ends with the metrics of an uninterrupted
one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import warnings

import numpy as np
import torch

from ...errors import ClientsLost, FedMosaicError, one_line
from ...protocol.tree import to
from ..client.runtime import NonFiniteLoss
from ..messages import merge_evaluations, merge_logits, order_parts, row, rows_of, sub_request
from .local import InProcessPool
from .raylib import (
    CONNECT_ENV,
    check_socket_path,
    ray_module,
    register_tensors,
)

#: where an action's arguments hold an actor's own rows of the assignment
MINE = object()
#: the runtimes this process started itself (engine.ray.address: none): their resources are fixed
OWN_RUNTIME: list[str] = []
#: a custom resource every runtime fedmosaic starts for one run carries: it belongs to that run (and dies with it),
#: so another run that finds it (engine.ray.address: auto finds any Ray runtime on the machine) refuses to join
PRIVATE = "fedmosaic_private_runtime"


# ---- the actor ----------------------------------------------------------------------------------------------
class ClientHost:
    """One actor: the runtime of the clients ``shard`` (sorted ids), built from the run's config and its
    partition ``fd`` (from the object store), with ``threads`` torch threads. ``registered``: what the config uses
    that the driver's process registered (``register_model``, ``register_dataset`` of a public dataset: a script's
    own travel by value); ``data_dirs``: the driver's data search path (a public dataset is read from it)."""

    def __init__(self, make, fd, shard, threads: int, registered: dict, data_dirs: str):
        import ray

        from ... import models as zoo
        from ...data import registry
        from ...paths import set_data_dirs

        torch.set_num_threads(threads)
        register_tensors(ray)
        set_data_dirs(data_dirs)
        for name, (factory, head) in registered["models"].items():
            zoo.MODELS[name] = factory
            if head is not None:
                zoo.HEADS[name] = head
        registry.REGISTRY.update(registered["datasets"])
        warnings.filterwarnings("ignore")  # the driver has said it already (execution notes, data warnings)
        self.rt = make(fd, shard, threads)

    def hello(self):
        """(the clients it hosts, its process id, its node's address)"""
        import ray

        return self.rt.hosted(), os.getpid(), ray.util.get_node_ip_address()

    def call(self, action: str, *args, **shared):
        """``action`` of the runtime on ``args`` (``shared``: more fields of its one dict argument, read once from
        the object store); a non-finite loss comes back as its message, not raised through Ray."""
        args = to(list(args), self.rt.device)
        if shared:
            args = [{**to(shared, self.rt.device), **args[0]}]
        try:
            return getattr(self.rt, action)(*args)
        except NonFiniteLoss as e:
            return NonFiniteLoss(str(e))

    def peak_rss_mb(self) -> float:
        """This process's peak resident memory (``VmHWM``), MiB."""
        return peak_rss_mb()


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def shards(num_clients: int, actors: int) -> list[np.ndarray]:
    """Contiguous ranges of client ids, one per actor (never an empty one)."""
    return [s for s in np.array_split(np.arange(num_clients), min(actors, num_clients)) if len(s)]


# ---- the driver's side ------------------------------------------------------------------------------------
class RayPool:
    """The clients of ``fed`` (a ``Federation``) on ``opts.actors`` Ray actors (``opts``: ``engine.ray``) of
    ``threads`` torch threads and ``memory`` bytes (None: no limit), each actor's runtime built there by
    ``make(fd, shard, threads)`` (``setup.world.remote_runtime`` with the run's config: it travels by reference).
    ``registered``: the models and datasets the driver's process registered that the run uses (a script's own
    travel by value)."""

    def __init__(self, fed, make, opts, threads: int, memory: int | None, registered: dict):
        from ...paths import data_dirs

        self.ray = ray = ray_module()
        self.opts, self.device, self.algo = opts, fed.device, fed.algo
        self.address = self._connect()
        self.gcs = self.ray.get_runtime_context().gcs_address  # where the runtime's GCS listens (meta.json)
        register_tensors(ray)
        o = opts
        bundle = {"CPU": o.cpus_per_actor, **({"GPU": o.gpus_per_actor} if o.gpus_per_actor else {}),
                  **({"memory": memory} if memory else {})}
        parts = shards(fed.num_clients, o.actors)
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.actors: list = []
        if ray.get_runtime_context().gcs_address in OWN_RUNTIME:  # a runtime of this machine's: it cannot grow
            total = ray.cluster_resources()
            if any(v * len(parts) > total.get(k, 0) + 1e-9 for k, v in bundle.items()):
                raise FedMosaicError(
                    f"this machine cannot place {len(parts)} Ray actors of {_resources(bundle)}: it has "
                    f"{_resources(_totals(total))} in all; lower engine.ray.actors, cpus_per_actor, gpus_per_actor or "
                    "engine.memory_mb, or run on a cluster (engine.ray.address)")
        self.group = placement_group([bundle] * len(parts), strategy="SPREAD")
        self._remove_group = remove_placement_group
        if not self.group.wait(timeout_seconds=o.start_timeout_s):
            have = _totals(ray.cluster_resources())
            self.close()
            raise FedMosaicError(
                f"the Ray cluster cannot place {len(parts)} actors of {_resources(bundle)} within "
                f"{o.start_timeout_s:g} s (engine.ray.start_timeout_s): it has {_resources(have)} in all; lower "
                "engine.ray.actors, cpus_per_actor, gpus_per_actor or engine.memory_mb, or add nodes")
        fd = ray.put(fed.fd)  # the partition once; every actor takes its rows
        host = ray.remote(ClientHost)
        self.actors = [
            host.options(num_cpus=o.cpus_per_actor, num_gpus=o.gpus_per_actor, memory=memory, max_restarts=0,
                         scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, i)).remote(
                make, fd, part, threads, registered, os.pathsep.join(map(str, data_dirs())))
            for i, part in enumerate(parts)]
        try:
            ready = ray.get([a.hello.remote() for a in self.actors], timeout=o.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise FedMosaicError(f"the Ray actors did not start within {o.start_timeout_s:g} s "
                                 "(engine.ray.start_timeout_s)") from None
        except ray.exceptions.RayError as e:
            self.close()
            raise self._error(e, "starting its clients") from None
        self._hosted = [h for h, _, _ in ready]
        self.clients = [h.clients for h in self._hosted]
        self.where = [{"clients": len(c), "pid": pid, "node": node}
                      for c, (_, pid, node) in zip(self.clients, ready, strict=True)]

    def _connect(self) -> str:
        """Join the configured cluster (or the Ray runtime this process already has), else start a local one."""
        ray, o = self.ray, self.opts
        if ray.is_initialized():
            return ray.get_runtime_context().gcs_address
        if o.address is None:
            check_socket_path()
            try:
                ray.init(include_dashboard=False, log_to_driver=False, object_store_memory=o.object_store_mb * 2**20,
                         resources={PRIVATE: 1.0})
            except ValueError as e:  # e.g. an object store larger than the machine's memory
                raise FedMosaicError(f"engine.ray.object_store_mb: {one_line(str(e), 300)}") from None
            OWN_RUNTIME.append(ray.get_runtime_context().gcs_address)
            return "local"
        if o.address != "auto":
            host, _, port = o.address.rpartition(":")
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
            except ValueError:
                raise FedMosaicError(f"engine.ray.address: 'host:port' of the head node, 'auto' or none (got "
                                     f"{o.address!r})") from None
            except OSError as e:
                raise FedMosaicError(f"cannot reach the Ray cluster at {o.address} (engine.ray.address): "
                                     f"{e.strerror or e}; is `ray start --head` running there?") from None
        for k, v in CONNECT_ENV.items():
            os.environ.setdefault(k, v)
        try:
            ray.init(address=o.address, log_to_driver=False, logging_level=logging.WARNING)  # errors: one line
        except ConnectionError as e:
            raise FedMosaicError(f"cannot join the Ray cluster at {o.address} (engine.ray.address): "
                                 f"{one_line(str(e), 300)}") from None
        if PRIVATE in ray.cluster_resources():
            found = ray.get_runtime_context().gcs_address
            ray.shutdown()
            raise FedMosaicError(
                f"engine.ray.address: {o.address!r} found {found}, the private Ray runtime of another fedmosaic run "
                "(it ends with that run); start a cluster of your own with `ray start --head` and give its address, "
                "or leave engine.ray.address unset for a private runtime of this run's")
        return o.address

    def close(self) -> None:
        """Stop the actors and free their reservation (the Ray runtime stays for the next run)."""
        for a in self.actors:
            with contextlib.suppress(Exception):  # gone already
                self.ray.kill(a)
        self.actors = []
        if self.group is not None:
            with contextlib.suppress(Exception):
                self._remove_group(self.group)
            self.group = None

    # ---- messages -----------------------------------------------------------------------------------
    def _error(self, e: Exception, doing: str) -> Exception:
        """What a Ray failure means for the run: lost actors (:class:`ClientsLost`), or the actor's own error."""
        ex = self.ray.exceptions
        if isinstance(e, ex.RayTaskError):
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception) and not isinstance(cause, ex.RayError):
                return cause
        if isinstance(e, ex.ActorDiedError) and getattr(e, "actor_init_failed", False):
            return FedMosaicError(f"a Ray actor failed {doing}: {_cause_line(str(e))}")
        if isinstance(e, (ex.RayActorError, ex.ObjectLostError, ex.NodeDiedError)):
            return ClientsLost(f"a Ray actor was lost while {doing}: {_cause_line(str(e))}")
        return e

    def _gather(self, refs: list, doing: str) -> list:
        try:
            out = self.ray.get(refs)
        except self.ray.exceptions.RayError as e:
            raise self._error(e, doing) from None
        failed = [r for r in out if isinstance(r, NonFiniteLoss)]
        if failed:
            raise failed[0]
        return to(out, self.device)

    def _mine(self, assignment: dict) -> list:
        """Per actor hosting some of ``assignment``'s clients: (actor, its clients, their rows of it)."""
        rows = [(a, clients, rows_of(assignment, clients)) for a, clients in zip(self.actors, self.clients,
                                                                                  strict=True)]
        return [r for r in rows if r[2] is not None]

    def _each(self, action: str, assignment: dict, *args) -> list:
        """``action`` on every actor hosting some of ``assignment``'s clients, with their rows of it where ``args``
        has ``MINE``; a tree in ``args`` is put in the object store once and read from there by every actor."""
        args = [x if x is MINE or isinstance(x, (int, float)) else self.ray.put(x) for x in args]
        refs = [a.call.remote(action, *[mine if x is MINE else x for x in args])
                for a, _, mine in self._mine(assignment)]
        return self._gather(refs, action)

    notes = InProcessPool.notes

    def meta(self) -> dict:
        return {"ray": {"address": self.address, "gcs": self.gcs, "version": self.ray.__version__,
                        "actors": self.where}}

    def hosted(self) -> list:
        return list(self._hosted)

    def warm_up(self, lr: float, assignment: dict) -> None:
        self._each("warm_up", assignment, lr, MINE)

    def public_logits(self, broadcast: dict, assignment: dict, round_idx: int) -> dict:
        replies = self._each("public_logits", assignment, broadcast, MINE)
        return merge_logits([row(r, i) for r in replies for i in range(len(r["ids"]))])

    def train(self, header: dict, broadcast: dict, assignment: dict) -> list[dict]:
        return order_parts([p for parts in self._each("train", assignment, header, broadcast, MINE) for p in parts])

    def end_task(self, header: dict, payload: dict, assignment: dict, model) -> None:
        self._each("end_task", assignment, header, payload, MINE, model)

    def evaluate(self, request: dict) -> dict:
        own = ("assignment", "continual")  # each actor's rows; the rest once in the object store for all
        shared = {k: self.ray.put(v) for k, v in request.items() if k not in own}
        asked = [(a, sub_request(request, mine, clients)) for a, clients, mine in self._mine(request["assignment"])]
        refs = [a.call.remote("evaluate", {k: sub[k] for k in own if sub.get(k) is not None}, **shared)
                for a, sub in asked]
        return merge_evaluations(request, list(zip(self._gather(refs, "evaluate"), [s for _, s in asked],
                                                   strict=True)))

    def state(self) -> list[dict]:
        return self._gather([a.call.remote("state") for a in self.actors], "state")

    def load(self, parts: list[dict]) -> None:
        self._gather([a.call.remote("load", p) for a, p in zip(self.actors, parts, strict=True)], "load")

    def peak_rss_mb(self) -> list[float]:
        """Each actor's peak resident memory, MiB."""
        return self.ray.get([a.peak_rss_mb.remote() for a in self.actors])


def _totals(resources: dict) -> dict:
    """The CPUs, GPUs and memory among a Ray cluster's resources (``ray.cluster_resources()``)."""
    return {k: resources[k] for k in ("CPU", "GPU", "memory") if k in resources}


def _resources(res: dict) -> str:
    parts = [f"{v:g} {k}" if k != "memory" else f"{v / 2**20:,.0f} MiB memory" for k, v in res.items()]
    return ", ".join(parts) or "nothing"


def _cause_line(text: str) -> str:
    """The informative line of a Ray error (its last non-empty one: the cause), shortened."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return one_line(re.sub(r"^(?:\w+\.)+(?=\w+: )", "", lines[-1] if lines else text), 300)
