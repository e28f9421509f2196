"""What the ServerApp and the ClientApps agree on: the record a message travels in, a client's data fingerprint
and what a deployment cannot do."""

from __future__ import annotations

import hashlib

import numpy as np

from ..errors import ConfigError, FedMosaicError

#: The one ConfigRecord of every message, both ways: ``action``, ``token`` (the run), ``round``, ``stamp`` (the
#: client state the node must start from), ``nonce`` (fresh for every request), ``body`` (a ``protocol.codec``
#: message); a reply: ``client``, ``round``, ``nonce`` (the request's), ``body``, or ``error`` (one line).
RECORD = "fedmosaic"

#: Flower message type per client action: ``train``/``evaluate`` as Flower names them, the rest as actions of
#: those categories (state-changing ones under ``train``, read-only ones under ``query``).
MESSAGE_TYPES = {"hello": "query.hello", "warm_up": "train.warm_up", "logits": "query.logits", "train": "train",
                 "end_task": "train.end_task", "evaluate": "evaluate"}

#: A client's stamp before it has any state of its own: it starts from the algorithm's initial client state.
FRESH = -2


def flower():
    """The Flower modules (an optional extra), or one line that says how to install them."""
    try:
        import flwr.app
        import flwr.clientapp
        import flwr.serverapp
    except ImportError:
        raise FedMosaicError("deploying needs Flower: pip install 'fedmosaic[flower]'") from None
    return flwr


def rows_hash(fed, client: int) -> str:
    """SHA-256 of one client's rows (inputs and labels of its train, validation and test splits) as this process's
    partition has them: a node and the server that computed it from the same data and config agree."""
    h = hashlib.sha256()
    fd = fed.fd
    for s in ("train", "val", "test"):
        lo, hi = fd.ptr[s][client], fd.ptr[s][client + 1]
        for a in (fd.x[s][lo:hi], fd.y[s][lo:hi]):
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def public_hash(fed) -> str:
    """SHA-256 of the public stream (``data.public``) as this process built it ('' without one): noise from the run's
    seed, or another dataset's samples, must be the same on every node and the server."""
    if fed.public is None:
        return ""
    return hashlib.sha256(fed.public.x.cpu().contiguous().numpy().tobytes()).hexdigest()


def check_deployable(cfg, algo_cls) -> None:
    """Refuse, in one line, what only a simulation can run."""
    if algo_cls.pooled:
        raise ConfigError(f"algorithm {cfg.algorithm.name!r} trains on the pooled data of every client (a centralized "
                          "baseline): it cannot be deployed")
    if cfg.eval.cross_clients:
        raise ConfigError("eval.cross_clients: the K x K matrix needs every client's test split in one place; a "
                          "deployment cannot measure it (set it to false)")
    if cfg.eval.local_models:
        raise ConfigError("eval.local_models: in/out-local accuracy needs the clients' label histograms on the "
                          "server; a deployment does not measure it (set it to false)")
    if cfg.engine.compile is True:
        raise ConfigError("engine.compile: a node trains one client per message in a fresh process, where compiling "
                          "never repays; use 'auto' or false")
    if cfg.engine.pool != "local":
        raise ConfigError("engine.pool: a deployment's clients are its nodes; leave engine.pool at 'local'")
    if cfg.attack is not None:
        raise ConfigError("attack: simulated attackers are for simulations; a deployment's attackers are real nodes "
                          "(its defence, aggregation:, applies there as in a simulation)")
    if cfg.compare or cfg.seeds:
        raise ConfigError("compare/seeds: a deployment runs one algorithm with one seed; deploy each run's config")
