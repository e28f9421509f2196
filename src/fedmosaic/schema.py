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


def unused(section: BaseModel, choice: str, uses: dict[str, set[str]], common: set[str] = frozenset()) -> None:
    """Refuse a setting the section's ``choice`` field (e.g. an optimizer's name) does not read, where it differs
    from its default (a saved config, which writes every default, passes): ``uses`` maps each value of the choice
    to the fields it reads; ``common`` are read whatever it is."""
    picked = getattr(section, choice)
    for name, field in type(section).model_fields.items():
        if name == choice or name in common or name in uses.get(picked, set()):
            continue
        if getattr(section, name) != field.get_default(call_default_factory=True):
            who = sorted(k for k, v in uses.items() if name in v)
            raise ValueError(f"{name}: {choice} {picked!r} does not use it (used by {', '.join(map(repr, who))}); "
                             "remove it")
