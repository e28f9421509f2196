"""Model registry: built-in models by name, plus any ``nn.Module`` a user registers."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable

import torch
from torch import nn

from .. import plugins
from ..errors import ConfigError
from .base import FedModel, Projected, Wrapped
from .mobile import MOBILE
from .plain import Plain
from .resnet import RESNETS
from .zoo import MLP, LinearSVM, LogisticRegression, apfl_cnn, cnn4, fedavg_cnn

ModelFactory = Callable[..., nn.Module]

MODELS: dict[str, ModelFactory] = {
    "logreg": LogisticRegression,
    "svm": LinearSVM,
    "mlp": MLP,
    "fedavg_cnn": fedavg_cnn,
    "apfl_cnn": apfl_cnn,
    "cnn4": cnn4,
    **RESNETS,
    **MOBILE,
}


#: the classifier head of a registered plain nn.Module, where its registration names one
HEADS: dict[str, str] = {}


def register_model(name: str, factory: ModelFactory | None = None, *, head: str | None = None):
    """Register ``factory(input_shape, num_classes, **options)`` under ``name`` (usable as a decorator).

    The factory returns a FedModel, or any plain ``nn.Module`` (e.g. the class itself): its classifier head is then
    the sub-module named ``head``, by default its last ``nn.Linear`` with one output per class, and its feature is
    that head's input. Registering a name again from the same module replaces it (a notebook cell run twice)."""

    if not isinstance(name, str) or not plugins.NAME.fullmatch(name):
        raise ConfigError(f"register_model(name, factory): the name {name!r} must be letters, digits, '_', '.' or "
                          "'-' (at most 64)" + (" — the name comes first: register_model('mynet', MyNet)"
                                                if callable(name) else ""))

    def _add(f: ModelFactory) -> ModelFactory:
        try:  # refused here, not in round 0: the engine calls it with these two arguments (options by name)
            inspect.signature(f).bind_partial((1,), 2)
        except TypeError:
            what = getattr(f, "__name__", type(f).__name__)
            raise ConfigError(f"register_model({name!r}): the engine calls {what}(input_shape, num_classes, "
                              f"**options), which it does not accept; register a factory such as "
                              f"`lambda input_shape, num_classes: {what}(...)`") from None
        except ValueError:  # no signature to inspect (a builtin): the probe in build_model will tell
            pass
        plugins.claim("model", name, name in MODELS)
        MODELS[name] = f
        if head is None:
            HEADS.pop(name, None)
        else:
            HEADS[name] = head
        return f

    return _add(factory) if factory is not None else _add


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def build_model(name: str, input_shape, num_classes: int, **options) -> FedModel:
    """The model ``name`` for inputs of ``input_shape`` and ``num_classes`` classes.

    Whatever cannot work is a one-line ConfigError: an unknown name, options the factory refuses, a model that is not
    a FedModel, or one that cannot take the input (e.g. a CNN whose pooling shrinks an 8x8 image to nothing) or does
    not return ``num_classes`` logits and ``feature_dim`` features; the model is tried on two fixed random inputs.
    """
    shape = tuple(input_shape)
    where = f"model {name!r}" + (f" with options {options}" if options else "")
    model = _construct(name, shape, num_classes, options, where)
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
    # a fixed random probe, not zeros: on zeros a head followed by more layers could still match (Plain.check)
    probe = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0)).to(device)
    training = model.training
    try:
        model.eval()  # BatchNorm must not update its statistics on the probe
        with torch.no_grad():
            z, logits = model(probe, with_features=True)
            if isinstance(model, Plain):
                model.check(z, logits)
    except NotImplementedError:
        return model.train(training)  # an op without a meta kernel: the real forward will tell
    except ConfigError:
        raise
    except (TypeError, ValueError, RuntimeError, IndexError) as e:
        raise ConfigError(f"{where} cannot take inputs of shape {shape}: {_first_line(e)}") from None
    finally:
        model.train(training)
    if tuple(logits.shape) != (2, num_classes) or tuple(z.shape) != (2, model.feature_dim):
        raise ConfigError(f"{where}: on inputs of shape {shape} it gives logits {tuple(logits.shape[1:])} and "
                          f"features {tuple(z.shape[1:])}, expected ({num_classes},) and ({model.feature_dim},)")
    return model


def check_name(name: str, where: str = "model.name") -> None:
    """An unknown model's name is one line, with the plug-in that may be missing and the nearest known name."""
    if name not in MODELS:
        near = difflib.get_close_matches(name, MODELS, n=1) if isinstance(name, str) else []
        guess = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(f"{where}: unknown {name!r}{plugins.hint('model')}; {guess}"
                          f"allowed: {', '.join(sorted(MODELS))}")


def _construct(name: str, shape: tuple, num_classes: int, options: dict, where: str) -> FedModel:
    check_name(name)
    options = dict(options)
    project = options.pop("project", None)
    if project is not None and (type(project) is not int or not 1 <= project <= 1 << 20):
        raise ConfigError(f"{where}: project: must be a feature size >= 1 (got {project!r})")
    try:
        model = MODELS[name](shape, num_classes, **options)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"{where}: {_first_line(e)}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{where}: its factory returned a {type(model).__name__}, not an nn.Module")
    odd = next(((k, p) for k, p in model.named_parameters() if p.dtype != torch.float32 or not p.requires_grad),
               None)
    if odd is not None:  # the engine trains (and averages, and sends) every parameter in float32
        k, p = odd
        raise ConfigError(f"{where}: parameter {k!r} is " + (f"{p.dtype}: fedmosaic trains float32 parameters "
                          "(engine.precision: bf16 runs the forward pass in bfloat16)" if p.dtype != torch.float32
                          else "frozen (requires_grad=False): fedmosaic trains every parameter; keep a fixed "
                          "tensor as a buffer (register_buffer)"))
    if not isinstance(model, FedModel):
        model = Plain(model, num_classes, HEADS.get(name), name, where)
    return model if project is None else Projected(model, project, num_classes)


def norm_keys(model: nn.Module) -> tuple[str, ...]:
    """The names of the parameters of the model's BatchNorm layers (their affine weight and bias), found by the
    layers' type, however they are named: what FedBN keeps on each client."""
    return tuple(f"{m}.{p}" if m else p for m, mod in model.named_modules()
                 if isinstance(mod, nn.modules.batchnorm._BatchNorm) for p, _ in mod.named_parameters(recurse=False))


def head_keys(model: FedModel) -> tuple[str, ...]:
    """The names of the parameters ``model.head`` uses (the classifier; the rest is the feature extractor), found
    by differentiating the head's output on a feature batch: any FedModel, however its modules are named."""
    params = dict(model.named_parameters())
    dev = next(iter(params.values())).device if params else torch.device("cpu")
    z = torch.zeros(2, model.feature_dim, device=dev, requires_grad=True)
    with torch.enable_grad():
        out = model.head(z).sum()
        grads = torch.autograd.grad(out, list(params.values()), allow_unused=True) if out.requires_grad else []
    return tuple(k for k, g in zip(params, grads, strict=False) if g is not None)


def construct(name: str, input_shape, num_classes: int, **options) -> FedModel:
    """The model ``name`` as its factory makes it, unchecked (on the current default device: under
    ``torch.device("meta")`` nothing is allocated) — for measuring it before building it for real."""
    where = f"model {name!r}" + (f" with options {options}" if options else "")
    return _construct(name, tuple(input_shape), num_classes, options, where)


def parameter_count(name: str, input_shape, num_classes: int, **options) -> int:
    """Parameters and buffers of the model, counted on the meta device (nothing is allocated), so a request for a
    model that cannot fit in memory is refused before it is built."""
    where = f"model {name!r}" + (f" with options {options}" if options else "")
    with torch.device("meta"):  # constructed only: a forward pass on meta tensors costs a second of imports
        model = _construct(name, tuple(input_shape), num_classes, options, where)
    return sum(t.numel() for t in [*model.parameters(), *model.buffers()])


__all__ = ["FedModel", "Wrapped", "MODELS", "register_model", "build_model", "construct", "head_keys", "norm_keys",
           "parameter_count"]
