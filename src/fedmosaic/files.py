"""Writing files so that a crash, a kill or a full disk never leaves a half-written one in place.

Every file fedmosaic produces (run files, checkpoints, partitions, plots, downloads) is written to a hidden temporary
file beside its target and renamed over it only when complete, with the permissions an ordinary ``open()`` would give
(``0o666`` minus the umask; ``mkstemp`` alone would leave them ``0600``). A failure removes the temporary file.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .errors import FedMosaicError

TEMP_SUFFIX = ".tmp"
#: the names ``atomic_write`` gives its temporary files: hidden, the target's name, mkstemp's 8 random
#: characters
_TEMP_NAME = re.compile(rf"\..+\.[a-z0-9_]{{8}}{re.escape(TEMP_SUFFIX)}")


def refuse_dangling(path: Path, flag: str = "--out") -> None:
    """A ``path`` through a symbolic link whose target is gone would fail only at its first write, as "File
    exists", and one below a file as "Not a directory": both refused at once, in one line that names the link or
    the file (nothing is created)."""
    for p in (path, *path.parents):
        if p.exists():
            if p != path and not p.is_dir():
                raise FedMosaicError(f"{flag} {path}: {p} is a file, not a folder; choose another {flag}")
            return
        if p.is_symlink():
            raise FedMosaicError(f"{flag} {path}: {p} is a symbolic link to {os.readlink(p)}, which does not "
                                 f"exist; create that or choose another {flag}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()


def atomic_write(path: str | Path, data: bytes | Callable[[BinaryIO], object], *, suffix: str = TEMP_SUFFIX,
                 exclusive: bool = False, durable: bool = True) -> Path:
    """Write ``data`` (bytes, or a function that writes to a binary file) to ``path`` atomically.

    ``exclusive``: never replace an existing ``path`` (FileExistsError instead): of two processes that claim the
    same file at once, exactly one wins. ``durable``: the bytes and the new name reach the disk before this returns
    (fsync of the file, then of its folder), so a power cut after it leaves the new file whole, not an empty one
    under the new name; off only for scratch files nothing reads after the process."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, bytes):
                f.write(data)
            else:
                data(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if exclusive:
            try:
                os.link(tmp, path)  # fails if path exists, atomically
            except FileExistsError as e:
                raise FileExistsError(e.errno, e.strerror, str(path)) from None  # name the target, not the temp
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    """The folder's entries (a rename, a new name) to the disk; a file system that cannot open a folder skips."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the file's own bytes are already on disk
    finally:
        os.close(fd)


def set_aside(path: Path, suffix: str, data: bytes | None = None) -> Path:
    """``path`` renamed to ``path + suffix`` (``data``: a copy of those bytes written there instead), or to
    ``.1``, ``.2``, ... after it when that name is taken: a file set aside before (a damaged checkpoint, an
    older backup of the metrics) is never replaced. Returns the new name."""
    for i in range(10_000):
        new = path.with_name(path.name + suffix + (f".{i}" if i else ""))
        try:
            if data is None:
                os.link(path, new)  # fails if new exists, atomically
            else:
                atomic_write(new, data, exclusive=True)
        except FileExistsError:
            continue
        if data is None:
            path.unlink()
        return new
    raise FedMosaicError(f"{path}: 10,000 files set aside beside it already; move some away")


def is_temp(path: Path) -> bool:
    """``path`` is a temporary file of ``atomic_write``'s, by its name: a user's own ``notes.tmp`` in a folder
    they point fedmosaic at is not one, and is never deleted."""
    return _TEMP_NAME.fullmatch(path.name) is not None and path.is_file()


def remove_temp_files(*folders: Path) -> list[Path]:
    """Delete the temporary files a killed process left in ``folders`` (they are never complete); returns them."""
    found = [p for d in folders if d.is_dir() for p in d.iterdir() if is_temp(p)]
    for p in found:
        p.unlink(missing_ok=True)
    return found
