"""Algorithms, registered by name with their hyper-parameters as typed config."""

from . import (  # noqa: F401  (registration)
    ditto,
    fedavg,
    fedavgm,
    fedcurv,
    fednova,
    fedntd,
    fedproto,
    fedprox,
    local,
    moon,
    scaffold,
)
from .base import ALGORITHMS, AlgoConfig, Algorithm, register_algorithm

__all__ = ["ALGORITHMS", "AlgoConfig", "Algorithm", "register_algorithm"]

