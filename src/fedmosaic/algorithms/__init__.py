"""Algorithms, registered by name with their hyper-parameters as typed config."""

from . import ditto, fedavg, fedprox, fedproto, local  # noqa: F401  (registration)
from .base import ALGORITHMS, AlgoConfig, Algorithm, register_algorithm

__all__ = ["ALGORITHMS", "AlgoConfig", "Algorithm", "register_algorithm"]
