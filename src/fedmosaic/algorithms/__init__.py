"""Algorithms, registered by name with their hyper-parameters as typed config."""

from ..protocol.algorithm import ALGORITHMS, AlgoConfig, Algorithm, register_algorithm
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
    feddf,
    feddyn,
    fedewc,
    fedkd,
    fedlwf,
    fedmd,
    fednova,
    fedntd,
    fedpac,
    fedpmr,
    fedproto,
    fedprox,
    fedrecon,
    fedrod,
    fedsi,
    fedweit,
    glfc,
    local,
    meta,
    moon,
    pfedme,
    pfedsrb,
    protofcl,
    rhfl,
    scaffold,
    split,
)

__all__ = ["ALGORITHMS", "AlgoConfig", "Algorithm", "register_algorithm"]

