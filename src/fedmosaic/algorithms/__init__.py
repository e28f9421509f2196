"""Algorithms, registered by name with their hyper-parameters as typed config."""

from . import (  # noqa: F401  (registration)
    ahf,
    apfl_pd,
    central,
    ditto,
    fccl,
    fedala,
    fedavg,
    fedavgm,
    fedcurv,
    fedewc,
    feddf,
    fedkd,
    fedlwf,
    fedmd,
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
    protofcl,
    rhfl,
    scaffold,
)
from .base import ALGORITHMS, AlgoConfig, Algorithm, register_algorithm

__all__ = ["ALGORITHMS", "AlgoConfig", "Algorithm", "register_algorithm"]

