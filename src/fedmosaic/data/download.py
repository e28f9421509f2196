"""Fetch a dataset's files from their canonical URLs into the first data directory, verified, atomically."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import logging
import os
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path, PurePosixPath

from ..errors import CorruptDataError, DataNotFoundError
from ..files import atomic_write
from ..paths import download_dir
from .datasets._io import one_line
from .registry import DatasetSpec, Source

log = logging.getLogger(__name__)

TIMEOUT_S = 60
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_CHUNK = 1 << 20


def download_file(src: Source, dest_dir: Path) -> Path:
    """Download ``src`` to ``dest_dir / src.filename``; it appears only complete and (if pinned) verified."""
    target = Path(dest_dir) / src.filename

    def fetch(out) -> None:
        digest = hashlib.sha256()
        log.info("downloading %s", src.url)
        with urllib.request.urlopen(src.url, timeout=TIMEOUT_S) as response:
            for chunk in iter(lambda: response.read(_CHUNK), b""):
                digest.update(chunk)
                out.write(chunk)
        if src.sha256 and digest.hexdigest() != src.sha256.lower():
            raise CorruptDataError(
                f"{target}: download from {src.url} has SHA-256 {digest.hexdigest()}, expected {src.sha256}; "
                "discarded it"
            )

    made = next((p for p in reversed(target.parents) if not p.exists()), None)  # the first folder made for it

    def unmake() -> None:  # a failed download leaves no empty dataset folder to be taken for a broken one
        if made is None:
            return
        with contextlib.suppress(OSError):
            for d in [target.parent, *target.parent.parents]:
                d.rmdir()  # (empty only: refuses otherwise)
                if d == made:
                    break

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return atomic_write(target, fetch, suffix=".part")
    except (OSError, http.client.HTTPException) as exc:  # URLError and socket timeouts are OSErrors
        unmake()
        raise DataNotFoundError(f"cannot download {src.url} to {target}: {one_line(exc)}") from exc
    except BaseException:  # (a hash mismatch, a signal)
        unmake()
        raise


def download_dataset(spec: DatasetSpec) -> Path:
    """Fetch every file of ``spec.downloads`` into ``<first data dir>/<spec.folder>`` and unpack tar archives.

    Files already there are kept. Archives are unpacked only while the first layout's files are still missing;
    plain ``.gz`` files are left compressed because the readers decompress them themselves.
    """
    if not spec.downloads:
        raise DataNotFoundError(f"dataset {spec.name!r} has no download source: put its files in place")
    dest = download_dir() / spec.folder
    for src in spec.downloads:
        if not (dest / src.filename).exists():
            download_file(src, dest)
    if not all((dest / f).exists() for f in spec.layouts[0].files):
        for src in spec.downloads:
            if src.filename.endswith(TAR_SUFFIXES):
                _extract_tar(dest / src.filename, dest)
    return dest


def _extract_tar(path: Path, dest: Path) -> None:
    """Unpack into a temp folder, then move each top-level entry into place: no half-unpacked tree is left."""
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=dest))
    try:
        try:
            with tarfile.open(path) as tar:
                members = tar.getmembers()
                for m in members:  # refuse absolute paths, "..", links, devices (what filter="data" does)
                    p = PurePosixPath(m.name)
                    if p.is_absolute() or ".." in p.parts or not (m.isfile() or m.isdir()):
                        raise tarfile.TarError(f"unsafe member {m.name!r}")
                extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                tar.extractall(tmp, members=members, **extra)
        except (OSError, EOFError, tarfile.TarError) as exc:
            msg = f"{path}: cannot unpack it ({one_line(exc)}); delete it and download again"
            raise CorruptDataError(msg) from exc
        for entry in tmp.iterdir():
            final = dest / entry.name
            # the layout check failed, so an existing entry is an incomplete earlier copy: replace it
            if final.is_dir() and not final.is_symlink():
                shutil.rmtree(final)
            elif final.exists() or final.is_symlink():
                final.unlink()
            os.replace(entry, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
