"""fedmosaic: federated learning when clients differ.

The Python API (``fedmosaic.api``): ``run``, ``compare``, ``Result``, ``register_dataset``, ``register_model``; your own
algorithm: ``register_algorithm``, ``Algorithm``, ``AlgoConfig``, ``TaskLoss`` and ``Prox`` (README, "Write your own
algorithm").
"""

from .version import __version__ as __version__  # (re-exported)

#: name -> the module it comes from (imported on first use)
_FROM = {**dict.fromkeys(("Result", "compare", "register_dataset", "register_model", "run"), "api"),
         **dict.fromkeys(("Algorithm", "AlgoConfig", "register_algorithm"), "protocol.algorithm"),
         "TaskLoss": "protocol.context", "Prox": "algorithms.terms"}
__all__ = sorted([*_FROM, "__version__"])


def __getattr__(name: str):
    # imported on first use: the command line imports this package too, and must not pay for torch to print --help
    if name in _FROM:
        import importlib

        return getattr(importlib.import_module(f".{_FROM[name]}", __name__), name)
    raise AttributeError(f"module 'fedmosaic' has no attribute {name!r}")
