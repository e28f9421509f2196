"""Algorithms, registered by name with their hyper-parameters as typed config."""

from . import (  # noqa: F401  (registration)
    apfl_pd,
    central,
    ditto,
    fedala,
    fedpac,
    fedavg,
    fedavgm,
    fedcurv,
    fednova,
    fedntd,
    fedproto,
    fedprox,
    local,
    meta,
    moon,
    pfedme,
    pfedsrb,
    scaffold,
)
from .base import ALGORITHMS, AlgoConfig, Algorithm, register_algorithm

__all__ = ["ALGORITHMS", "AlgoConfig", "Algorithm", "register_algorithm"]

