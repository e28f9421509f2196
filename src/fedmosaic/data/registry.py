"""Dataset registry: one entry per dataset name, each with a loader and the files it needs."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import plugins
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
        import difflib

        near = difflib.get_close_matches(name.lower(), dataset_names(), n=1)
        guess = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"unknown dataset {name!r}{plugins.hint('dataset')}{guess}; allowed: "
                          f"{', '.join(dataset_names())}") from None


def register_dataset(name: str, x_train, y_train, x_test=None, y_test=None, *, classes: int | list[str] | None = None,
                     input_shape: tuple[int, ...] | None = None, description: str = "") -> DatasetSpec:
    """Register arrays as the dataset ``name``: partitioned, normalised, hashed and cached like a built-in one.

    ``x_*``: one row per sample; ``uint8`` images ``(N, C, H, W)`` are pixel values 0..255, anything else becomes
    float32 features (``(N, D)`` or any shape your model takes); ``input_shape`` reshapes each row (e.g. ``(1, 28,
    28)`` for flat rows). ``y_*``: integer labels 0..C-1. ``classes``: the class names, or their number C (default:
    the largest label + 1). Without a test split there is no global test set: evaluate on the clients' own
    (``data.client_test``). The arrays are copied: changing yours afterwards changes nothing registered.
    """
    if not isinstance(name, str) or not plugins.NAME.fullmatch(name):
        raise ConfigError(f"register_dataset: the name {name!r} must be letters, digits, '_', '.' or '-' (at most 64)")
    if (x_test is None) != (y_test is None):
        raise ConfigError(f"register_dataset({name!r}): give both x_test and y_test, or neither")
    where = f"register_dataset({name!r})"
    xtr, ytr = _inputs(x_train, f"{where}: x_train", input_shape), _labels(y_train, f"{where}: y_train", x_train)
    xte, yte = (None, None) if x_test is None else (_inputs(x_test, f"{where}: x_test", input_shape),
                                                     _labels(y_test, f"{where}: y_test", x_test))
    if xte is not None and (xte.shape[1:] != xtr.shape[1:] or xte.dtype != xtr.dtype):
        raise ConfigError(f"register_dataset({name!r}): x_test rows are {xte.dtype} {xte.shape[1:]}, x_train rows "
                          f"{xtr.dtype} {xtr.shape[1:]}; they must match")
    if isinstance(classes, np.ndarray) and classes.ndim == 1:  # (np.unique's first result, say)
        classes = classes.tolist()
    if classes is None:
        top = 1 + max(int(y.max()) for y in (ytr, yte) if y is not None and len(y))
        distinct = len(np.unique(np.concatenate([y for y in (ytr, yte) if y is not None])))
        if top > 1000 and top > 2 * distinct:  # labels as ids (20230101), not 0..C-1: before C names are made
            raise ConfigError(f"{where}: its labels span {top:,} classes, {top - distinct:,} of them without a "
                              "sample; give labels 0..C-1 (np.unique(y, return_inverse=True))")
        names = [str(c) for c in range(top)]
    elif isinstance(classes, (int, np.integer)) and not isinstance(classes, bool):
        names = [str(c) for c in range(int(classes))]
    elif isinstance(classes, (list, tuple)) and len(set(map(str, classes))) == len(classes):
        names = [str(c) for c in classes]
    else:
        raise ConfigError(f"register_dataset({name!r}): classes must be the number of classes or a list of distinct "
                          f"names (got {str(classes)[:60]})")
    if len(names) < 2:
        raise ConfigError(f"register_dataset({name!r}): needs at least 2 classes (got {len(names)})")
    for y, what in ((ytr, "y_train"), (yte, "y_test")):
        if y is not None and len(y) and not (0 <= y.min() and y.max() < len(names)):
            raise ConfigError(f"register_dataset({name!r}): {what} holds labels {y.min()}..{y.max()}, outside "
                              f"0..{len(names) - 1} ({len(names)} classes)")
    present = np.zeros(len(names), dtype=bool)
    present[ytr] = True
    unused = np.flatnonzero(~present).tolist()
    if unused:  # trained as classes that never occur: said, not silent
        warnings.warn(f"{where}: {len(unused)} of its {len(names)} classes {'has' if len(unused) == 1 else 'have'} "
                      f"no training sample (e.g. "
                      f"{', '.join(map(str, unused[:5]))}); they count as classes (logits, per-class accuracy). "
                      "Give labels 0..C-1 (np.unique(y, return_inverse=True)) unless that is meant", stacklevel=2)
    key = name.lower()
    _ensure_loaded()
    plugins.claim("dataset", key, key in REGISTRY)
    ds = ArrayDataset(key, xtr, ytr, xte, yte, names, meta={"registered_by": plugins.ORIGINS[("dataset", key)]})
    spec = DatasetSpec(key, ".", (Layout("arrays", (), lambda _folder: ds),), builtin=True,
                       description=description or f"{len(ytr)} samples registered by {ds.meta['registered_by']}")
    REGISTRY[key] = spec  # a name registered again by the same module is replaced (plugins.claim)
    return spec


def _inputs(x, what: str, shape) -> np.ndarray:
    a = np.asarray(x)
    if shape is not None:
        try:
            a = a.reshape(len(a), *shape)
        except (ValueError, TypeError):
            raise ConfigError(f"{what} of shape {a.shape} cannot be read as rows of input_shape "
                              f"{shape}") from None
    if a.ndim < 2 or not len(a):
        raise ConfigError(f"{what} must hold one row per sample, (N, ...) with N >= 1 (got shape "
                          f"{a.shape}); a single feature per sample is x.reshape(-1, 1)")
    if a.dtype == np.uint8:
        if a.ndim == 4 and a.shape[3] in (1, 3, 4) and a.shape[1] not in (1, 3, 4):
            warnings.warn(f"{what} of shape {a.shape} looks channels-last (N, H, W, C); it is read as (N, C, H, W) "
                          f"images of {a.shape[1]} channels: pass x.transpose(0, 3, 1, 2) if it is", stacklevel=3)
        return a.copy()
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == bool) or np.iscomplexobj(a):
        raise ConfigError(f"{what} must hold real numbers (got dtype {a.dtype})")
    a = a.astype(np.float32)
    if not np.isfinite(a).all():
        raise ConfigError(f"{what} holds NaN or infinite values")
    return a


def _labels(y, what: str, x) -> np.ndarray:
    a = np.asarray(y)
    if a.ndim != 1 or len(a) != len(x):
        raise ConfigError(f"{what} must hold one label per sample, shape ({len(x)},) (got {a.shape})")
    if not np.issubdtype(a.dtype, np.integer):
        raise ConfigError(f"{what} must hold integer labels 0..C-1 (got dtype {a.dtype}); for names, "
                          "classes, y = np.unique(y, return_inverse=True)")
    return a.astype(np.int64)


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
        f"(searched {', '.join(str(r) + ('' if Path(r).is_dir() else ' [no such folder]') for r in roots)}; "
        "set FEDMOSAIC_DATA or --data-dir"
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
