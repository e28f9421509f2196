"""Algorithms, registered by name with their hyper-parameters as typed config."""

from . import (  # noqa: F401  (registration)
    apfl_pd,
    central,
    ditto,
    fedala,
    fedavg,
    fedavgm,
    fedcurv,
    fedkd,
    fednova,
    fedntd,
    fedpac,
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

