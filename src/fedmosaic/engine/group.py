"""An architecture group: the clients that share one architecture, its module, trainer and rows of the client store
(shared by the client and the server side)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..protocol.tree import repeat, tmap

if TYPE_CHECKING:
    from .client.execution import Execution
    from .client.local import LocalTrainer


class Group:
    """Clients that share one architecture: its module, its trainer and its rows of the client store.

    ``buffers`` holds every client's module buffers (BatchNorm running statistics), stacked; ``global_buffers``
    the server's copy for algorithms with a global model (broadcast with it, averaged like it); ``task_buffers``
    per client those of the model it predicted with at the end of its previous task (a continual teacher's).
    """

    def __init__(self, gid: int, module: torch.nn.Module, clients: np.ndarray):
        self.gid, self.module, self.clients = gid, module, clients
        self.init = {k: v.detach().clone() for k, v in module.named_parameters()}
        self.global_buffers = {k: v.detach().clone() for k, v in module.named_buffers()}
        self.buffers = repeat(self.global_buffers, len(clients))
        self.task_buffers = tmap(torch.clone, self.buffers)
        self.trainer: LocalTrainer | None = None
        self.execution: Execution | None = None
        #: what autograd keeps for one client's step (``preflight.activation_bytes``), bytes
        self.activations = 0
        #: what a compiled trainer's graphs depend on (``setup.groups.compile_key``): its compile-cache marker
        self.compile_key: str | None = None
        self.store: dict = {}

    def global_buffers_like(self, n: int) -> dict:
        """The server's buffers repeated for ``n`` clients."""
        return repeat(self.global_buffers, n)

    def apply(self, params, x, slot=None):
        """(features, logits) of the group's model (or of ``slot``'s own architecture) with ``params``."""
        return self.trainer.apply(params, x, slot=slot)
