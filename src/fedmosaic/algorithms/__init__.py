"""Algorithms, registered by name with their hyper-parameters as typed config."""

from . import (  # noqa: F401  (registration)
    ahf,
    apfl_pd,
    central,
    cfed,
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
    glfc,
    fedproto,
    fedprox,
    fedweit,
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

