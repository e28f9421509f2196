"""What the runtimes of a round read of a run's configuration (:class:`RoundSettings`), and nothing more.

``setup`` builds it once from the ``RunConfig``; no runtime, pool or driver below ``setup`` sees the whole config —
its data, model, engine and file settings have become values there (a world: ``setup.world.World``). A deployment's
node or a Ray actor receives the same value its driver's runtimes do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import (
        AggregationConfig,
        AttackConfig,
        EvalConfig,
        MemoryConfig,
        ParticipationConfig,
        PrivacyConfig,
        TrainConfig,
    )


@dataclass(frozen=True)
class RoundSettings:
    seed: int  #: the run seed: every cohort, batch order, drop-out and attack derives from it
    algorithm: str  #: the algorithm's registered name (for messages)
    train: TrainConfig  #: cohort size, learning-rate schedule, warm-up epochs
    eval: EvalConfig  #: what an evaluation measures
    participation: ParticipationConfig | None  #: drop-outs, stragglers, held-out clients
    attack: AttackConfig | None  #: simulated Byzantine clients
    aggregation: AggregationConfig | None  #: a robust stage, a server optimizer
    privacy: PrivacyConfig | None  #: client-level differential privacy
    memory: MemoryConfig | None  #: every client's exemplar memory (class-incremental replay)
    named_rows: bool  #: one client per domain: the cross-client matrix names its rows by the domain
