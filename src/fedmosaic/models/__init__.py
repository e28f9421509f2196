"""Model registry: built-in models by name, plus any ``nn.Module`` a user registers."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..errors import ConfigError
from .base import FedModel, Wrapped
from .zoo import MLP, LinearSVM, LogisticRegression, apfl_cnn, cnn4, fedavg_cnn

ModelFactory = Callable[..., nn.Module]

MODELS: dict[str, ModelFactory] = {
    "logreg": LogisticRegression,
    "svm": LinearSVM,
    "mlp": MLP,
    "fedavg_cnn": fedavg_cnn,
    "apfl_cnn": apfl_cnn,
    "cnn4": cnn4,
}


def register_model(name: str, factory: ModelFactory | None = None):
    """Register ``factory(input_shape, num_classes, **options) -> FedModel`` under ``name`` (usable as a decorator)."""

    def _add(f: ModelFactory) -> ModelFactory:
        if name in MODELS:
            raise ValueError(f"model {name!r} is already registered")
        MODELS[name] = f
        return f

    return _add(factory) if factory is not None else _add


def build_model(name: str, input_shape, num_classes: int, **options) -> FedModel:
    if name not in MODELS:
        raise ConfigError(f"model.name: unknown {name!r}; allowed: {', '.join(sorted(MODELS))}")
    try:
        model = MODELS[name](tuple(input_shape), num_classes, **options)
    except TypeError as e:
        raise ConfigError(f"model {name!r}: {e}") from None
    if not isinstance(model, FedModel):
        raise ConfigError(f"model {name!r} must return a FedModel (features/head); wrap it with fedmosaic.models.Wrapped")
    return model


__all__ = ["FedModel", "Wrapped", "MODELS", "register_model", "build_model"]
