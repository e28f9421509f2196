"""Quantity skew: client sizes from a heavy-tailed law, labels IID."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from .base import (
    MAX_SAMPLES,
    MAX_SIGMA,
    PartitionScheme,
    Parts,
    largest_remainder,
    require_samples_per_client,
)


class QuantitySkew(PartitionScheme):
    """Every client gets ``min_size`` samples plus a share of the rest proportional to a random weight.

    ``distribution="lognormal"``: weight ~ lognormal(0, sigma); the log-mean would only rescale all weights,
    so it is not a parameter. ``distribution="power_law"``: weight ~ Pareto with x_min = 1 and tail index
    ``exponent``, i.e. P(w > x) = x^-exponent. Shares are rounded by largest remainder. All samples are
    assigned, drawn uniformly at random, so each client's labels follow the global label distribution.

    ``sigma`` <= 20 and ``exponent`` >= 0.05 keep the weights finite in practice (a Pareto draw is
    expm1(E / exponent) with E ~ Exp(1)); a weight that still overflows to inf takes an equal share of
    everything with the other infinite ones (see ``largest_remainder``).
    """

    scheme: Literal["quantity"] = "quantity"
    distribution: Literal["lognormal", "power_law"] = "lognormal"
    sigma: float = Field(1.0, gt=0, le=MAX_SIGMA)
    exponent: float = Field(1.5, ge=0.05, le=1e6)
    min_size: int = Field(10, ge=1, le=MAX_SAMPLES)

    def _split(self, labels: np.ndarray, n_clients: int, rng: np.random.Generator, groups) -> Parts:
        require_samples_per_client(len(labels), n_clients, self.min_size, "partition.min_size")
        if self.distribution == "lognormal":
            weights = rng.lognormal(0.0, self.sigma, n_clients)
        else:
            weights = rng.pareto(self.exponent, n_clients) + 1.0
        extra = largest_remainder(weights, len(labels) - n_clients * self.min_size, rng)
        cuts = np.cumsum(extra + self.min_size)[:-1]
        return [np.sort(p).astype(np.int64) for p in np.split(rng.permutation(len(labels)), cuts)]
