"""Client-level differential privacy's accounting: the (epsilon, delta) a run has spent, by dp-accounting's RDP
accountant at fixed orders, over the rounds' cohorts as the engine samples them (docs/design.md "Client-level
differential privacy"). The mechanisms themselves (clipping, noise) are ``robust.private`` and ``robust.local``."""

from __future__ import annotations

import collections
import functools
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ConfigError

if TYPE_CHECKING:
    from .settings import RoundSettings


def accountant():
    try:
        import dp_accounting
    except ImportError:
        raise ConfigError("privacy: its accountant is dp-accounting: pip install 'fedmosaic[privacy]'") from None
    return dp_accounting


#: the RDP orders, fixed here (dp-accounting's own default list) so that a library update cannot move our epsilons
ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]


def rdp_epsilon(noise: float, steps: int, delta: float, *, poisson: float | None = None,
                fixed: tuple[int, int] | None = None) -> float:
    """epsilon at ``delta`` of ``steps`` compositions of the Gaussian mechanism (noise multiplier ``noise``), each
    on a Poisson sample of rate ``poisson`` (neighbours add or remove one record) or a fixed-size sample ``fixed``
    = (population, sample) without replacement (neighbours replace one record), or on everything: RDP accounting
    (dp-accounting) at the orders ``ORDERS``."""
    return _epsilon(noise, {(poisson, fixed): steps}, delta)


def _epsilon(noise: float, steps: dict, delta: float) -> float:
    """epsilon at ``delta`` of compositions of several kinds: ``steps`` maps (poisson, fixed) to how many."""
    accountant()
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    if not sum(steps.values()):
        return 0.0
    if noise == 0:
        return float("inf")
    rdp = sum(n * np.asarray(_round_rdp(noise, *kind)) for kind, n in steps.items() if n)
    return float(compute_epsilon(ORDERS, rdp, delta)[0])


@functools.lru_cache(maxsize=64)
def _round_rdp(noise: float, poisson: float | None, fixed: tuple[int, int] | None) -> tuple[float, ...]:
    """One composition's RDP at ``ORDERS``, as dp-accounting's accountant computes it (a tenth of a second for a
    sample without replacement): RDP adds up over compositions, so ``steps`` of them cost one product, not one
    such computation per round and per query."""
    dp = accountant()
    from dp_accounting import rdp

    event = dp.GaussianDpEvent(noise)
    relation = dp.NeighboringRelation.ADD_OR_REMOVE_ONE
    if poisson is not None:
        event = dp.PoissonSampledDpEvent(poisson, event)
    elif fixed is not None and fixed[1] < fixed[0]:
        event = dp.SampledWithoutReplacementDpEvent(fixed[0], fixed[1], event)
        relation = dp.NeighboringRelation.REPLACE_ONE
    acc = rdp.RdpAccountant(ORDERS, neighboring_relation=relation)
    acc.compose(event)
    return tuple(acc._rdp)  # (the accountant's own composition: count x this vector)


def epsilon(s: RoundSettings, populations: list[int]) -> float:
    """The client-level epsilon (at ``privacy.delta``) of the rounds whose cohorts were drawn from ``populations``
    clients (per round: those that can be sampled, neither held out nor without a task then):
    ``train.clients_per_round`` of them sampled without replacement, as the engine samples its cohorts. Local: a
    client's own uploads, as if it took part in every round (its sampling is no secret to it), each a Gaussian
    mechanism of std sigma C on a clipped update that any other data of the client moves by up to 2C (multiplier
    sigma / 2)."""
    p = s.privacy
    if p.mode == "local":
        return rdp_epsilon(p.noise / 2, len(populations), p.delta)
    k = s.train.clients_per_round
    return _epsilon(p.noise, collections.Counter((None, (n, min(k, n))) for n in populations), p.delta)
