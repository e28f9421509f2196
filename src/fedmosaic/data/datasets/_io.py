"""Low-level readers shared by the loaders: error mapping, IDX, CIFAR pickles, archives, LEAF JSON."""

from __future__ import annotations

import gzip
import json
import math
import pickle
import struct
import sys
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ...errors import CorruptDataError, FedMosaicError
from ..base import ArrayDataset

# What a truncated or malformed file raises somewhere inside numpy/gzip/zipfile/scipy/PIL/json. A malformed
# *structure* (a JSON list where a dict belongs, a missing npz key) surfaces as KeyError/TypeError/IndexError.
_PARSE_ERRORS = (
    OSError, EOFError, ValueError, KeyError, IndexError, TypeError, struct.error, zlib.error,
    pickle.UnpicklingError, zipfile.BadZipFile, tarfile.TarError,
)


def _parse_errors() -> tuple[type[BaseException], ...]:
    """:data:`_PARSE_ERRORS` and, once a .mat reader has imported scipy.io, its MatReadError (scipy is not
    imported at start-up for it: a fraction of a second of every run)."""
    mat = sys.modules.get("scipy.io.matlab")
    return _PARSE_ERRORS + ((mat.MatReadError,) if mat is not None else ())


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


@contextmanager
def reading(what: str | Path) -> Iterator[None]:
    """Re-raise a parse failure while reading ``what`` as a one-line CorruptDataError that names it."""
    try:
        yield
    except FedMosaicError:
        raise
    except _parse_errors() as exc:
        raise CorruptDataError(
            f"{what}: cannot read it ({type(exc).__name__}: {one_line(exc)}); it looks truncated or corrupt, "
            "replace it with a fresh copy"
        ) from exc


def abs_paths(paths: Iterable[Path]) -> list[str]:
    return [str(Path(p).resolve()) for p in paths]


def digit_splits(name: str, paths: list[Path], read_split) -> ArrayDataset:
    """A 10-digit dataset from a train file and a test file, each read by ``read_split(path) -> (x, y)``."""
    (x_train, y_train), (x_test, y_test) = (read_split(p) for p in paths)
    return ArrayDataset(name=name, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                        classes=[str(d) for d in range(10)], source_files=abs_paths(paths))


def read_maybe_gzip(path: Path) -> bytes:
    """The file's bytes, gunzipped when it is gzip data (checked by magic number, not by file name)."""
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    with (gzip.open if gz else open)(path, "rb") as f:
        return f.read()


_IDX_DTYPES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """An array from an IDX file (the MNIST format), plain or gzipped."""
    with reading(path):
        data = read_maybe_gzip(path)
        if len(data) < 4 or data[:2] != b"\0\0" or data[2] not in _IDX_DTYPES:
            raise ValueError("not an IDX file (bad magic number)")
        ndim = data[3]
        dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
        dtype = np.dtype(_IDX_DTYPES[data[2]])
        body = data[4 + 4 * ndim :]
        expected = math.prod(dims) * dtype.itemsize
        if len(body) != expected:
            raise ValueError(f"header promises {expected} data bytes, file has {len(body)}")
        # astype copies into a writable, native-endian array (frombuffer alone is a read-only view of `data`)
        return np.frombuffer(body, dtype).reshape(dims).astype(dtype.newbyteorder("="))


# The globals a pickled numpy array needs (numpy 1 and 2 spellings); nothing else may be loaded.
_PICKLE_GLOBALS = frozenset({
    ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
})


class _ArrayUnpickler(pickle.Unpickler):
    """CIFAR's python batches are pickles: allow only numpy arrays, so a tampered file cannot run code."""

    def find_class(self, module: str, name: str):
        if (module, name) not in _PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a data file")
        if module.startswith("numpy.core.") and hasattr(np, "_core"):
            module = "numpy._core." + module.removeprefix("numpy.core.")  # numpy 2 renamed it: skip the shim
        return super().find_class(module, name)


def load_pickle(path: Path) -> dict:
    """A python-2 style pickled dict with bytes keys, as the official CIFAR batches are."""
    with reading(path), open(path, "rb") as f:
        return _ArrayUnpickler(f, encoding="bytes").load()


def load_npz(path: Path, keys: Iterable[str]) -> dict[str, np.ndarray]:
    with reading(path), np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in keys}


def archive_members(path: Path, wanted: Callable[[str], bool]) -> dict[str, bytes]:
    """The bytes of every member of a tar(.gz) or zip archive whose name passes ``wanted``, keyed by name.

    Everything is read in one pass: a .tar.gz only supports sequential access.
    """
    with reading(path):
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                return {n: z.read(n) for n in z.namelist() if not n.endswith("/") and wanted(n)}
        with tarfile.open(path) as tar:
            return {m.name: tar.extractfile(m).read() for m in tar if m.isfile() and wanted(m.name)}


def folder_members(root: Path, wanted: Callable[[str], bool]) -> dict[str, Path]:
    """The files under ``root`` whose posix path relative to it passes ``wanted``, keyed by that path."""
    found = {}
    for p in sorted(root.rglob("*")):
        name = p.relative_to(root).as_posix()
        if wanted(name) and p.is_file():
            found[name] = p
    return found


def read_leaf_json(paths: Iterable[Path]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per user, (inputs float32 (n, D), raw labels float64 (n,)) from LEAF-format JSON files.

    LEAF JSON is ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[...]], "y": [...]}}}``;
    a user split over several files is concatenated.
    """
    users: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for path in paths:
        with reading(path), open(path, "rb") as f:
            doc = json.load(f)
            if not doc["users"]:
                raise ValueError("the file lists no users")
            for user in doc["users"]:
                data = doc["user_data"][user]
                x = np.asarray(data["x"], dtype=np.float32)
                y = np.asarray(data["y"], dtype=np.float64).reshape(-1)  # Vehicle nests each label in a list
                if x.ndim != 2 or len(x) != len(y):
                    raise ValueError(f"user {user!r}: x has shape {x.shape} but there are {len(y)} labels")
                if user in users:
                    x, y = np.concatenate([users[user][0], x]), np.concatenate([users[user][1], y])
                users[user] = (x, y)
    return users


def stack_users(
    users: dict[str, tuple[np.ndarray, np.ndarray]], names: list[str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Samples of the users in ``names`` order: inputs, raw labels, and each one's index in ``names``."""
    present = [(i, u) for i, u in enumerate(names) if u in users]
    x = np.concatenate([users[u][0] for _, u in present])
    y = np.concatenate([users[u][1] for _, u in present])
    groups = np.repeat([i for i, _ in present], [len(users[u][1]) for _, u in present]).astype(np.int64)
    return x, y, groups
