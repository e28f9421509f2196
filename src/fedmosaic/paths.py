"""Where fedmosaic looks for data and keeps its caches.

The data directory is a *search path*: ``--data-dir`` or ``FEDMOSAIC_DATA`` may list several folders separated by
``os.pathsep`` (``:`` on Linux), e.g. ``../shared/data:/usr/share/datasets``. Downloads go to the first entry.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_DATA = "FEDMOSAIC_DATA"
ENV_CACHE = "FEDMOSAIC_CACHE"

_override: list[Path] | None = None


def default_cache_dir() -> Path:
    base = os.environ.get(ENV_CACHE)
    if base:
        return Path(base).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "fedmosaic"


def set_data_dirs(spec: str | os.PathLike | list | None) -> list[Path] | None:
    """Override the data search path (the CLI's ``--data-dir``); ``None`` restores the default. Returns the
    override it replaced (to restore it with)."""
    global _override
    before, _override = _override, (None if spec is None else
                                    list(spec) if isinstance(spec, list) else _split(str(spec)))
    return before


def _split(spec: str) -> list[Path]:
    return [Path(p).expanduser() for p in spec.split(os.pathsep) if p]


def data_dirs() -> list[Path]:
    """The data search path, most specific first: --data-dir, then $FEDMOSAIC_DATA, then the per-user cache.

    System-wide dataset packages (Debian's ``/usr/share/datasets``) are searched last.
    """
    if _override is not None:
        dirs = list(_override)
    elif os.environ.get(ENV_DATA):
        dirs = _split(os.environ[ENV_DATA])
    else:
        dirs = [default_cache_dir() / "data"]
    system = Path("/usr/share/datasets")
    if system not in dirs:
        dirs.append(system)
    return dirs


def download_dir() -> Path:
    return data_dirs()[0]


def partition_cache_dir() -> Path:
    return default_cache_dir() / "partitions"
