"""A user's plain ``nn.Module`` as a FedModel: its classifier head is one of its sub-modules, its feature is what
that head receives.

Algorithms that work on representations or on the head alone (FedProto, MOON, FedPAC, ProtoFCL, personal heads)
need ``forward(x, with_features=True)`` and ``head(z)``. A plain module has neither, so the head is found by name
(``register_model(..., head="fc")``) or, by default, as its last ``nn.Linear`` with one output per class; the
feature is captured on the way into the head by a forward pre-hook, so the user's ``forward`` runs unchanged.
``build_model`` then checks on a probe input that the module's output is the head's output on that feature.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..errors import ConfigError
from .base import FedModel


class Plain(FedModel):
    def __init__(self, net: nn.Module, num_classes: int, head: str | None, name: str, where: str):
        super().__init__()
        self.net = net
        self.num_classes = num_classes
        self._where = where
        self._ask = f"give register_model({name!r}, ..., head='<the sub-module that outputs its {num_classes} logits>')"
        if head is None:
            found = [n for n, m in net.named_modules() if isinstance(m, nn.Linear) and m.out_features == num_classes]
            if not found:
                raise ConfigError(f"{where}: it has no nn.Linear with {num_classes} outputs (one per class) to take "
                                  f"as its classifier head; {self._ask}")
            head = found[-1]
        names = dict(net.named_modules())
        if head not in names or not head:
            shown = ", ".join(n for n in names if n)[:200]
            raise ConfigError(f"{where}: head={head!r} is not a sub-module of {type(net).__name__} (it has: {shown})")
        # the head's first nn.Linear receives the feature: its input size is the feature size
        first = next((m for m in names[head].modules() if isinstance(m, nn.Linear)), None)
        if first is None:
            raise ConfigError(f"{where}: head {head!r} holds no nn.Linear, so its feature size is unknown; name the "
                              "sub-module that starts with the classifier's nn.Linear")
        self.head_name, self.feature_dim = head, first.in_features
        # named after the user's class, which the run's messages and meta.json then show
        self.__class__ = _named(type(net).__name__)

    def head(self, z):
        return self.net.get_submodule(self.head_name)(z)

    def features(self, x):
        return self(x, with_features=True)[0]

    def forward(self, x, with_features: bool = False):
        if not with_features:
            return self.net(x)
        seen: list[torch.Tensor] = []
        hook = self.net.get_submodule(self.head_name).register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        try:
            logits = self.net(x)
        finally:
            hook.remove()
        if len(seen) != 1:
            raise ConfigError(f"{self._where}: {self.head_name!r}, taken as its classifier head, ran {len(seen)} "
                              f"times in one forward pass; {self._ask}")
        return seen[0], logits

    def check(self, z: torch.Tensor, logits: torch.Tensor) -> None:
        """On a probe: the network's output must be its head's output on the captured feature (a head followed by
        more layers, or a wrong guess, would silently train another split)."""
        if not isinstance(logits, torch.Tensor):
            raise ConfigError(f"{self._where}: its forward returns a {type(logits).__name__}, not one tensor of "
                              "logits per sample (return the logits; the feature is what its head receives)")
        if z.dim() != 2:
            raise ConfigError(f"{self._where}: {self.head_name!r}, taken as its classifier head, receives inputs "
                              f"of shape {tuple(z.shape[1:])}, not one flat feature vector per sample; {self._ask}")
        out = self.head(z)
        if out.shape != logits.shape or not torch.allclose(out, logits, rtol=1e-4, atol=1e-5):
            raise ConfigError(f"{self._where}: its output is not the output of {self.head_name!r}, taken as its "
                              f"classifier head; {self._ask}")


@functools.cache
def _named(name: str) -> type:
    return type(name, (Plain,), {"__module__": Plain.__module__})
