"""The contract every fedmosaic model follows: ``features(x)`` then ``head(z)``, with a declared feature size.

Algorithms that work on representations (FedProto, MOON, ProtoFCL, FedPAC) need the features; the engine calls models
through ``torch.func.functional_call``, which only reaches ``forward``, so ``forward(x, with_features=True)`` returns
``(features, logits)``.
"""

from __future__ import annotations

import torch
from torch import nn


class FedModel(nn.Module):
    feature_dim: int
    num_classes: int

    def features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head(self, z: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, with_features: bool = False):
        z = self.features(x)
        logits = self.head(z)
        return (z, logits) if with_features else logits


class Wrapped(FedModel):
    """Adapts any user ``nn.Module`` (``body`` producing features, ``classifier`` producing logits) to FedModel."""

    def __init__(self, body: nn.Module, classifier: nn.Linear):
        super().__init__()
        self.body = body
        self.classifier = classifier
        self.feature_dim = classifier.in_features
        self.num_classes = classifier.out_features

    def features(self, x):
        return self.body(x)

    def head(self, z):
        return self.classifier(z)


class Projected(FedModel):
    """``inner``'s features through a linear projection to ``dim`` (the feature) and a new linear head: the model
    option ``project: <dim>`` gives architectures of different feature sizes one common size (FedProto on mixed
    architectures). The inner model's own head is kept but unused."""

    def __init__(self, inner: FedModel, dim: int, num_classes: int):
        super().__init__()
        self.inner = inner
        self.proj = nn.Linear(inner.feature_dim, dim)
        self.fc = nn.Linear(dim, num_classes)
        self.feature_dim, self.num_classes = dim, num_classes

    def features(self, x):
        return self.proj(self.inner.features(x))

    def head(self, z):
        return self.fc(z)
