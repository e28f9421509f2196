"""Writing files so that a crash, a kill or a full disk never leaves a half-written one in place.

Every file fedmosaic produces (run files, checkpoints, partitions, plots, downloads) is written to a hidden temporary
file beside its target and renamed over it only when complete, with the permissions an ordinary ``open()`` would give
(``0o666`` minus the umask; ``mkstemp`` alone would leave them ``0600``). A failure removes the temporary file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TEMP_SUFFIX = ".tmp"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()


def atomic_write(path: str | Path, data: bytes | Callable[[BinaryIO], object], *, suffix: str = TEMP_SUFFIX,
                 exclusive: bool = False) -> Path:
    """Write ``data`` (bytes, or a function that writes to a binary file) to ``path`` atomically.

    ``exclusive``: never replace an existing ``path`` (FileExistsError instead): of two processes that claim the
    same file at once, exactly one wins."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, bytes):
                f.write(data)
            else:
                data(f)
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
    return path


def remove_temp_files(*folders: Path) -> list[Path]:
    """Delete the temporary files a killed process left in ``folders`` (they are never complete); returns them."""
    found = [p for d in folders if d.is_dir() for p in d.iterdir() if p.name.endswith(TEMP_SUFFIX) and p.is_file()]
    for p in found:
        p.unlink(missing_ok=True)
    return found
