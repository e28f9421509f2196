"""Seeded partitioners that split a labelled dataset over federated clients.

Every scheme is a pydantic model with a ``scheme`` discriminator; ``parse_partition`` turns a config dict into
one and reports mistakes as a one-line ConfigError. ``scheme.split(labels, n_clients, rng, groups)`` returns
one sorted ``int64`` index array per client. See METHODS.md section 1 for the settings these reproduce.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Union

from pydantic import Field, ValidationError

from ...errors import ConfigError
from .base import PartitionScheme, shown, validation_error_message
from .dirichlet import Dirichlet
from .generators import APFLMnist, FEMNISTLognormal, femnist_letters_a_to_j
from .iid import IID
from .label_k import LabelK
from .natural import Domains, Natural
from .quantity import QuantitySkew
from .shards import Shards
from .split import client_split
from .summary import class_counts, summary
from .tasks import task_streams

_ALL = (IID, Shards, Dirichlet, LabelK, QuantitySkew, APFLMnist, FEMNISTLognormal, Natural, Domains)

SCHEMES: dict[str, type[PartitionScheme]] = {cls.model_fields["scheme"].default: cls for cls in _ALL}

PartitionConfig = Annotated[Union[_ALL], Field(discriminator="scheme")]  # noqa: UP007


def parse_partition(d: dict | PartitionScheme, prefix: str = "partition") -> PartitionScheme:
    """The scheme model for a config mapping like ``{"scheme": "dirichlet", "alpha": 0.1}``.

    ``prefix`` is the config path that error messages name (e.g. ``data.partition``). Errors raised later by
    ``split`` always say ``partition.<param>``.
    """
    if isinstance(d, PartitionScheme):
        return d
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix}: must be a mapping with a 'scheme' key (got {type(d).__name__})")
    name = d.get("scheme")
    if not isinstance(name, str) or name not in SCHEMES:
        what = "missing" if name is None else f"unknown {shown(name)}"
        near = difflib.get_close_matches(name, SCHEMES, n=1) if isinstance(name, str) else []
        raise ConfigError(f"{prefix}.scheme: {what}; {f'did you mean {near[0]!r}? ' if near else ''}"
                          f"allowed: {', '.join(sorted(SCHEMES))}")
    cls = SCHEMES[name]
    try:
        return cls.model_validate(d)
    except ValidationError as err:
        raise ConfigError(validation_error_message(err, prefix, list(cls.model_fields))) from None


__all__ = [
    "IID",
    "SCHEMES",
    "APFLMnist",
    "Dirichlet",
    "Domains",
    "FEMNISTLognormal",
    "LabelK",
    "Natural",
    "PartitionConfig",
    "PartitionScheme",
    "QuantitySkew",
    "Shards",
    "class_counts",
    "client_split",
    "femnist_letters_a_to_j",
    "parse_partition",
    "summary",
    "task_streams",
]
