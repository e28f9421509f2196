"""Named run configurations shipped with the package (``fedmosaic run NAME``)."""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path

from ..errors import FedMosaicError


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(__package__).iterdir() if p.name.endswith(".yaml"))


def preset_path(name: str) -> Path | None:
    p = resources.files(__package__) / f"{name}.yaml"
    return Path(str(p)) if p.is_file() else None


def preset_choices(name: str) -> str:
    """What to tell a user whose ``name`` is no preset: the nearest preset if it looks mistyped, then all."""
    names = preset_names()
    near = difflib.get_close_matches(name, names, n=1)
    return f"{f'did you mean {near[0]!r}? ' if near else ''}presets: {', '.join(names)}"


def config_path(source: str) -> Path:
    """The config file ``source`` names: a file, else a preset; neither is one line naming the nearest preset."""
    path = Path(source)
    if path.is_file():
        return path
    found = preset_path(source) if source in preset_names() else None
    if found is None:
        what = "a directory, not a config file" if path.is_dir() else "neither a file nor a preset"
        raise FedMosaicError(f"config {source!r} is {what}; {preset_choices(source)}")
    return found
