"""fedmosaic: federated learning when clients differ.

The Python API (``fedmosaic.api``): ``run``, ``compare``, ``Result``, ``register_dataset``, ``register_model``.
"""

__version__ = "0.1.0"

__all__ = ["Result", "__version__", "compare", "register_dataset", "register_model", "run"]


def __getattr__(name: str):
    # imported on first use: the command line imports this package too, and must not pay for torch to print --help
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedmosaic' has no attribute {name!r}")
