"""The base of every typed config section: strict types, finite numbers, no unknown keys.

Strict means a YAML ``true`` is not an integer, ``"3"`` is not a number and ``5.0`` is not an integer (an integer is
still accepted where a float is expected); ``.inf`` and ``.nan`` are refused everywhere. Each section then states the
range of each of its numbers, so a config either means something or fails at load time with one line.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

#: The largest count any integer setting may take: beyond it numpy/torch index types overflow, and no real
#: federation, batch or round count comes close.
MAX_COUNT = 2**31 - 1
#: Seeds feed numpy's SeedSequence and torch generators (64-bit).
MAX_SEED = 2**63 - 1


class Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
