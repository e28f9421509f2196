"""FederatedData: every sample once, in contiguous arrays ordered by client, plus per-client index ranges.

Client k's train samples are ``x["train"][ptr["train"][k]:ptr["train"][k+1]]`` — a view, never a copy. ``src`` maps
each row back to the dataset's pooled index space (train rows first, then test rows), which is what gets saved:
a partition on disk is a manifest and the index arrays, and loading it re-reads the dataset and re-indexes.
The content hash covers the dataset's bytes and every index array, so the same config and seed give the same hash on
any machine, and any difference in the data or in which client holds which sample gives another (a parameter
that changes nothing, e.g. a Dirichlet ``min_size`` every draw already meets, leaves it as it was).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ConfigError, FedMosaicError
from ..files import atomic_write, is_temp, refuse_dangling, remove_temp_files, set_aside
from ..paths import partition_cache_dir
from .base import ArrayDataset, select_classes
from .partition import Natural, client_split, parse_partition, summary
from .registry import load_dataset

FORMAT = 1
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class PartitionSpec:
    """Everything that decides which client holds which sample."""

    dataset: str
    clients: int | None
    partition: dict
    pool: str = "train"  # "train": partition the train split (global test = official test); "all": pool train+test
    client_test: float = 0.0
    client_val: float = 0.0
    seed: int = 0
    classes: tuple[int, ...] | None = None  # keep only these classes, relabelled 0..k-1

    def load(self) -> ArrayDataset:
        ds = load_dataset(self.dataset)
        return select_classes(ds, list(self.classes)) if self.classes else ds

    def canonical(self) -> dict:
        scheme = parse_partition(dict(self.partition))
        if self.pool not in ("train", "all"):
            raise ConfigError(f"pool: must be 'train' or 'all' (got {self.pool!r})")
        return {
            "format": FORMAT,
            "dataset": self.dataset.lower(),
            "clients": self.clients,
            "partition": scheme.model_dump(mode="json"),
            "pool": self.pool,
            "client_test": self.client_test,
            "client_val": self.client_val,
            "seed": self.seed,
            "classes": None if self.classes is None else list(self.classes),
        }

    def key(self) -> str:
        return _sha(json.dumps(self.canonical(), sort_keys=True).encode())


@dataclass
class FederatedData:
    dataset: ArrayDataset
    spec: PartitionSpec
    src: dict[str, np.ndarray]  # split -> pooled indices, client-major
    ptr: dict[str, np.ndarray]  # split -> [K+1] offsets
    global_src: np.ndarray | None  # pooled indices of the global test set
    x: dict[str, np.ndarray] = field(init=False)
    y: dict[str, np.ndarray] = field(init=False)
    hash: str = field(init=False)

    def __post_init__(self):
        xp, yp = _pooled(self.dataset)
        self.x = {s: xp[self.src[s]] for s in SPLITS}
        self.y = {s: yp[self.src[s]] for s in SPLITS}
        self.x_global = xp[self.global_src] if self.global_src is not None else None
        self.y_global = yp[self.global_src] if self.global_src is not None else None
        h = hashlib.sha256(dataset_fingerprint(self.dataset).encode())
        for s in SPLITS:
            h.update(s.encode())
            h.update(self.ptr[s].astype("<i8").tobytes())
            h.update(self.src[s].astype("<i8").tobytes())
        if self.global_src is not None:
            h.update(self.global_src.astype("<i8").tobytes())
        self.hash = h.hexdigest()

    @property
    def num_clients(self) -> int:
        return len(self.ptr["train"]) - 1

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    def sizes(self, split: str = "train") -> np.ndarray:
        return np.diff(self.ptr[split])

    def client(self, k: int, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.ptr[split][k], self.ptr[split][k + 1]
        return self.x[split][lo:hi], self.y[split][lo:hi]

    def parts(self, split: str = "train") -> list[np.ndarray]:
        """Per-client index arrays into ``self.y[split]`` (for summaries and plots)."""
        p = self.ptr[split]
        return [np.arange(p[k], p[k + 1]) for k in range(self.num_clients)]

    def summary(self, split: str = "train") -> dict:
        return summary(self.y[split], self.parts(split), self.num_classes)

    def manifest(self) -> dict:
        s = {k: v for k, v in self.summary().items() if k != "counts"}
        return {
            "spec": self.spec.canonical(),
            "hash": self.hash,
            "dataset_fingerprint": dataset_fingerprint(self.dataset),
            "num_clients": self.num_clients,
            "num_classes": self.num_classes,
            "split_sizes": {sp: int(self.ptr[sp][-1]) for sp in SPLITS},
            "global_test": None if self.global_src is None else len(self.global_src),
            "summary": s,
        }

    def save(self, directory: str | Path) -> Path:
        """Write partition.npz, then manifest.json (which marks the partition complete).

        A directory that already holds this partition is completed (a missing file is written again); one that
        holds another partition, an unreadable manifest or a partition.npz of unknown origin is refused.
        """
        d = Path(directory)
        manifest = d / "manifest.json"
        if not d.is_dir():  # (before a folder is made; an existing one is judged once it is held: another
            check_partition_dir(d)  # save may be between its partition.npz and its manifest.json)
        d.mkdir(parents=True, exist_ok=True)
        lock = os.open(d, os.O_RDONLY)
        try:  # two commands saving to one new folder at once: the second waits, then finds the first's partition
            fcntl.flock(lock, fcntl.LOCK_EX)
            existing = check_partition_dir(d)
            if manifest.exists() and existing != self.hash:
                raise FedMosaicError(
                    f"{d} already holds a different partition (hash {str(existing)[:12]}); choose another --out"
                )
            remove_temp_files(d)
            arrays = {f"src_{s}": self.src[s] for s in SPLITS} | {f"ptr_{s}": self.ptr[s] for s in SPLITS}
            if self.global_src is not None:
                arrays["global_src"] = self.global_src
            if (d / "partition.npz").exists() and not _holds(d / "partition.npz", arrays):
                set_aside(d / "partition.npz", ".corrupt")  # (damaged: this partition's arrays are written anew)
            if not (d / "partition.npz").exists():
                atomic_write(d / "partition.npz", lambda f: np.savez(f, **arrays))
            if not manifest.exists():
                atomic_write(manifest, json.dumps(self.manifest(), indent=2).encode())
        finally:
            os.close(lock)
        return d

    @classmethod
    def load(cls, directory: str | Path, dataset: ArrayDataset | None = None) -> FederatedData:
        d = Path(directory)
        try:
            manifest = json.loads((d / "manifest.json").read_text())
            z = np.load(d / "partition.npz")
            arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError, KeyError) as e:
            raise FedMosaicError(f"{d}: not a readable fedmosaic partition ({type(e).__name__})") from None
        c = manifest["spec"]
        spec = PartitionSpec(c["dataset"], c["clients"], c["partition"], c["pool"], c["client_test"],
                             c["client_val"], c["seed"], None if c.get("classes") is None else tuple(c["classes"]))
        ds = dataset if dataset is not None else spec.load()
        if dataset_fingerprint(ds) != manifest["dataset_fingerprint"]:
            raise FedMosaicError(f"{d}: the dataset files of {spec.dataset!r} differ from those it was made from")
        fd = cls(ds, spec, {s: arrays[f"src_{s}"] for s in SPLITS}, {s: arrays[f"ptr_{s}"] for s in SPLITS},
                 arrays.get("global_src"))
        if fd.hash != manifest["hash"]:
            raise FedMosaicError(f"{d}: content hash mismatch; the partition files were modified")
        return fd


def _holds(path: Path, arrays: dict) -> bool:
    """``path`` (a partition.npz) reads whole and holds exactly ``arrays``."""
    try:
        with np.load(path) as z:
            return set(z.files) == set(arrays) and all(np.array_equal(z[k], v) for k, v in arrays.items())
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return False


def check_partition_dir(d: Path) -> str | None:
    """The hash of the partition ``d`` holds (None: it is new, or empty), checked before anything is computed
    or written: a folder that is not a partition of ours (a file, an unreadable manifest, anything but a
    partition in it) is refused, since nothing a user put there may be replaced or mixed with a partition."""
    if d.exists() and not d.is_dir():
        raise FedMosaicError(f"{d} exists and is not a directory; choose another --out")
    refuse_dangling(d)
    if (d / "manifest.json").exists():
        try:
            return json.loads((d / "manifest.json").read_text()).get("hash")
        except (OSError, ValueError, AttributeError):
            raise FedMosaicError(f"{d} holds an unreadable manifest.json; choose another --out") from None
    if (d / "partition.npz").exists():
        raise FedMosaicError(f"{d} holds a partition.npz without a manifest.json; choose another --out")
    theirs = sorted(p.name for p in d.iterdir() if not is_temp(p)) if d.is_dir() else []
    if theirs:
        more = " and more" if theirs[1:] else ""
        raise FedMosaicError(f"{d} already holds {theirs[0]!r}{more} and is not a partition folder (no "
                             "manifest.json); choose another --out")
    return None


def build(spec: PartitionSpec, dataset: ArrayDataset | None = None, cache: bool = True,
          clients_field: str = "data.clients") -> FederatedData:
    """The partition for ``spec``: from the cache when it was made before, else computed (and cached).

    ``clients_field`` is how the caller names the client count in errors (the schemes call it ``n_clients``)."""
    try:
        return _build(spec, dataset, cache)
    except ConfigError as e:
        if str(e).startswith("n_clients:"):
            raise ConfigError(clients_field + str(e).removeprefix("n_clients")) from None
        raise


def _build(spec: PartitionSpec, dataset: ArrayDataset | None, cache: bool) -> FederatedData:
    spec.canonical()  # validates the scheme before any data is read
    ds = dataset if dataset is not None else spec.load()
    cdir = partition_cache_dir() / f"{spec.dataset.lower()}-{spec.key()[:16]}"
    if cache and (cdir / "manifest.json").exists():
        try:
            return FederatedData.load(cdir, ds)
        except FedMosaicError:
            pass  # stale cache entry (dataset files changed): recompute below, into a fresh directory
        cdir = cdir.with_name(cdir.name + "-" + dataset_fingerprint(ds)[:8])
    fd = compute(spec, ds)
    if cache:
        try:
            fd.save(cdir)
        except (OSError, FedMosaicError):
            pass  # an unwritable cache must not stop a run
    return fd


def compute(spec: PartitionSpec, ds: ArrayDataset) -> FederatedData:
    scheme = parse_partition(dict(spec.partition))
    n_train = len(ds.y_train)
    has_test = ds.y_test is not None
    _, y_pool = _pooled(ds)
    groups = _pooled_groups(ds)
    pool = np.arange(n_train if spec.pool == "train" or not has_test else len(y_pool))
    rng = np.random.default_rng([spec.seed, 0xDA7A])
    paired_test = None
    if spec.pool == "train" and has_test and spec.client_test == 0:
        parts, paired_test = scheme.split_paired(
            y_pool[:n_train], ds.y_test, spec.clients, rng, None if groups is None else groups[:n_train]
        )
        if isinstance(scheme, Natural) and ds.groups_test is not None:
            # natural clients keep their own test samples (LEAF's per-writer split; a domain's test set)
            paired_test = scheme.test_parts(ds.groups_train, ds.groups_test, rng)
    else:
        parts = scheme.split(y_pool[pool], spec.clients, rng, None if groups is None else groups[pool])
    parts = [pool[p] for p in parts]
    fractions = {"test": spec.client_test, "val": spec.client_val}
    if any(fractions.values()):
        splits = client_split(y_pool, parts, fractions, rng)
    else:
        empty = [np.zeros(0, dtype=np.int64)] * len(parts)
        splits = {"train": parts, "val": empty, "test": empty}
    if paired_test is not None:
        splits["test"] = [p + n_train for p in paired_test]
    src = {s: _concat(splits[s]) for s in SPLITS}
    ptr = {s: np.concatenate([[0], np.cumsum([len(p) for p in splits[s]])]).astype(np.int64) for s in SPLITS}
    global_src = np.arange(n_train, len(y_pool)) if spec.pool == "train" and has_test else None
    return FederatedData(ds, spec, src, ptr, global_src)


def dataset_fingerprint(ds: ArrayDataset) -> str:
    cached = ds.derived.get("fingerprint")
    if cached is None:
        h = hashlib.sha256(ds.name.encode())
        for a in (ds.x_train, ds.y_train, ds.x_test, ds.y_test):
            if a is not None:
                h.update(str((a.shape, a.dtype.str)).encode())
                h.update(np.ascontiguousarray(a).data)
        cached = ds.derived["fingerprint"] = h.hexdigest()
    return cached


def _pooled(ds: ArrayDataset):
    if "pooled" not in ds.derived:
        if ds.x_test is None:
            ds.derived["pooled"] = (ds.x_train, ds.y_train.astype(np.int64))
        else:
            ds.derived["pooled"] = (np.concatenate([ds.x_train, ds.x_test]),
                                  np.concatenate([ds.y_train, ds.y_test]).astype(np.int64))
    return ds.derived["pooled"]


def _pooled_groups(ds: ArrayDataset):
    if ds.groups_train is None:
        return None
    if ds.x_test is None:
        return ds.groups_train
    gt = ds.groups_test if ds.groups_test is not None else np.full(len(ds.y_test), -1)
    return np.concatenate([ds.groups_train, gt])


def _concat(parts) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64) if len(parts) else np.zeros(0, dtype=np.int64)


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()
