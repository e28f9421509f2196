"""The version of fedmosaic (one place: the package root, the CLI, run metadata and deployed nodes read it here)."""

__version__ = "0.1.0"
