"""Named run configurations shipped with the package (``fedmosaic run NAME``)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(__package__).iterdir() if p.name.endswith(".yaml"))


def preset_path(name: str) -> Path | None:
    p = resources.files(__package__) / f"{name}.yaml"
    return Path(str(p)) if p.is_file() else None
