"""Dataset registry: one entry per dataset name, each with a loader and the files it needs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, DataNotFoundError
from ..paths import data_dirs
from .base import ArrayDataset


@dataclass(frozen=True)
class Source:
    """A downloadable file: where it lives relative to the dataset folder, its canonical URL and SHA-256."""

    filename: str
    url: str
    sha256: str | None = None


@dataclass(frozen=True)
class Layout:
    """One on-disk layout a dataset can be read from: the files that must all exist inside ``folder``."""

    name: str
    files: tuple[str, ...]
    read: Callable[[Path], ArrayDataset]


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    folder: str  # sub-folder of a data directory, e.g. "mnist"
    layouts: tuple[Layout, ...]
    description: str = ""
    downloads: tuple[Source, ...] = ()  # files of the *first* layout, for users with internet
    builtin: bool = False  # needs no files (e.g. scikit-learn digits)
    aliases: tuple[str, ...] = field(default=())
    #: a dataset derived from another registered one's files (e.g. "cifar10" for greyscale CIFAR-10): its layouts
    #: read that dataset's files, and ``data list --verify`` checks them under that dataset's name
    variant_of: str | None = None
    #: a dataset made of other registered datasets (the Digits domains): found when every part is, verified as them
    parts: tuple[str, ...] = ()


REGISTRY: dict[str, DatasetSpec] = {}


def register(spec: DatasetSpec) -> DatasetSpec:
    for key in (spec.name, *spec.aliases):
        if key in REGISTRY:
            raise ValueError(f"dataset {key!r} registered twice")
        REGISTRY[key] = spec
    return spec


def dataset_names() -> list[str]:
    _ensure_loaded()
    return sorted({s.name for s in REGISTRY.values()})


def get_spec(name: str) -> DatasetSpec:
    _ensure_loaded()
    try:
        return REGISTRY[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown dataset {name!r}; allowed: {', '.join(dataset_names())}") from None


def find_layout(spec: DatasetSpec) -> tuple[Layout, Path] | None:
    """The first (layout, folder) on the search path where every file of the layout exists."""
    if spec.builtin:
        return spec.layouts[0], Path(".")
    if spec.parts:
        return (spec.layouts[0], Path(".")) if all(find_layout(get_spec(p)) for p in spec.parts) else None
    for root in data_dirs():
        folder = root / spec.folder
        for layout in spec.layouts:
            if all((folder / f).exists() for f in layout.files):
                return layout, folder
    return None


def missing_message(spec: DatasetSpec) -> str:
    if spec.parts:  # name the first part that is missing, and how to get it
        part = next(get_spec(p) for p in spec.parts if find_layout(get_spec(p)) is None)
        return f"dataset {spec.name!r} needs {', '.join(spec.parts)}: {missing_message(part)}"
    roots = data_dirs()
    options = "; or ".join(", ".join(layout.files) for layout in spec.layouts)
    return (
        f"dataset {spec.name!r} not found: put {options} in <data-dir>/{'' if spec.folder == '.' else spec.folder + '/'} "
        f"(searched {', '.join(str(r) for r in roots)}; set FEDMOSAIC_DATA or --data-dir"
        + (", or run `fedmosaic data download " + spec.name + "`" if spec.downloads else "")
        + ")"
    )


def load_dataset(name: str, download: bool = False) -> ArrayDataset:
    """Load a registered dataset from the data search path (downloading first if asked and possible)."""
    spec = get_spec(name)
    found = find_layout(spec)
    if found is None and download and spec.downloads:
        from .download import download_dataset

        download_dataset(spec)
        found = find_layout(spec)
    if found is None:
        raise DataNotFoundError(missing_message(spec))
    layout, folder = found
    return layout.read(folder)


def _ensure_loaded() -> None:
    from . import datasets  # noqa: F401  (importing registers every built-in dataset)
