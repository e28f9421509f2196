"""Check dataset files against ``SHA256SUMS`` files and the registry's pinned download hashes.

Expected hashes come from, for each data directory ``ROOT`` of the search path:

* ``ROOT/SHA256SUMS``, paths relative to ``ROOT`` (``sha256sum`` output: ``<hex>  ./mnist/mnist.npz``);
* ``ROOT/<dataset folder>/SHA256SUMS``, paths relative to that folder.

Lines are ``<64 hex>  path`` or ``<64 hex> *path`` (binary mode), a leading ``./`` is dropped, blank lines and ``#``
comments are skipped; ``sha256sum --tag`` lines (``SHA256 (path) = <hex>``) are read too.

An entry is checked when it names a file of a registered dataset: anything inside the dataset's own folder, or, for
datasets kept at the top of a data directory (``folder="."``), a file of one of its layouts or downloads (a layout
entry ending in ``/`` covers every file under it). Each such file is ok, ``BAD`` (other hash), ``MISSING`` or
``UNREADABLE``; any of the last three fails the verification. Files of a found dataset's layout that no entry lists
are counted as unchecked. Entries naming no dataset's file are counted, not checked.

A file with a pinned ``Source.sha256`` is compared with the pin too. The pin describes the canonical download, and
legitimate copies can differ from it (a lossless rebuild, Debian's recompressed Fashion-MNIST), so a differing pin
is a warning, never a failure: where a SHA256SUMS lists the file, that entry decides; where none does, the file is
reported as differing from its pin (a repackaged copy, or damaged) and counted as not verified.
"""

from __future__ import annotations

import errno
import hashlib
import os
import posixpath
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..paths import data_dirs
from .registry import DatasetSpec

SUMS = "SHA256SUMS"
CHUNK = 1 << 20

OK, BAD, MISSING, UNREADABLE, DIFFERS = "ok", "BAD", "MISSING", "UNREADABLE", "DIFFERS"
FAILED = (BAD, MISSING, UNREADABLE)

_GNU = re.compile(r"([0-9A-Fa-f]{64}) [ *](.+)")
_BSD = re.compile(r"SHA256 \((.+)\) = ([0-9A-Fa-f]{64})")
_FORMAT = "'<64 hex digits>  <path>' or '<64 hex digits> *<path>'"


@dataclass(frozen=True)
class Entry:
    """One line of a SHA256SUMS file: the file it names (joined to the SHA256SUMS folder) and its hash."""

    path: Path
    sha256: str
    where: str  # "<SHA256SUMS path>:<line>"


@dataclass
class SumsFile:
    path: Path
    entries: list[Entry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # malformed lines, or why the file cannot be read


def _unescape(name: str) -> str:
    # GNU sha256sum writes a leading backslash, then "\\" and "\n", for names with a backslash or newline
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), name)


def parse_sums(path: Path) -> SumsFile:
    """Read one SHA256SUMS file; malformed lines and read errors become ``problems``, never exceptions."""
    out = SumsFile(path)
    try:
        text = path.read_bytes().decode("utf-8", "surrogateescape")
    except OSError as exc:
        out.problems.append(f"UNREADABLE {path} ({exc.strerror or type(exc).__name__})")
        return out
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.lstrip(" \t")
        if not line.strip() or line.startswith("#"):
            continue
        escaped = line.startswith("\\")
        body = line[1:] if escaped else line
        gnu, bsd = _GNU.fullmatch(body), _BSD.fullmatch(body)
        if gnu:
            digest, name = gnu.group(1), gnu.group(2)
        elif bsd:
            name, digest = bsd.group(1), bsd.group(2)
        else:
            shown = raw if len(raw) <= 80 else raw[:77] + "..."
            out.problems.append(f"{path}:{number}: malformed line {shown!r} (expected {_FORMAT})")
            continue
        name = _unescape(name) if escaped else name
        while name.startswith("./"):
            name = name[2:]
        out.entries.append(Entry(path.parent / posixpath.normpath(name), digest.lower(), f"{path}:{number}"))
    return out


@dataclass
class FileCheck:
    """The verdict on one file. ``expected``/``source``: the entry (or pin) it was compared with."""

    path: Path
    status: str
    actual: str | None = None
    expected: str | None = None
    source: str = ""
    error: str = ""
    pin: str | None = None  # a listed file that also has a registry pin: OK or DIFFERS

    def message(self) -> str:
        if self.status == BAD:
            return f"BAD {self.path} (sha256 {self.actual[:12]}…, expected {self.expected[:12]}… by {self.source})"
        if self.status == MISSING:
            return f"MISSING {self.path} (listed in {self.source})"
        if self.status == UNREADABLE:
            return f"UNREADABLE {self.path} ({self.error})"
        if self.status == DIFFERS:
            return (f"warning: {self.path} differs from the registry's download pin (sha256 {self.actual[:12]}…, "
                    f"pinned {self.expected[:12]}…): a repackaged copy, or damaged; list it in a SHA256SUMS to "
                    "verify it")
        return f"ok {self.path}"


@dataclass
class DatasetReport:
    name: str
    found: bool
    checks: list[FileCheck] = field(default_factory=list)
    unchecked: int = 0  # files of the found layout that no SHA256SUMS lists and no pin covers

    def count(self, status: str) -> int:
        return sum(c.status == status for c in self.checks)

    @property
    def failures(self) -> list[FileCheck]:
        return [c for c in self.checks if c.status in FAILED]

    def verdict(self) -> str:
        """E.g. ``ok        2 files checked; 1 unchecked (in no SHA256SUMS)``, ``FAILED    2 files checked: 1 BAD, 1 ok``."""
        n = len(self.checks)
        word = ("FAILED" if self.failures else "warning" if self.count(DIFFERS) else "ok" if n else "unchecked")
        counts = [f"{k} {s}" for s in (*FAILED, OK) if (k := self.count(s))]
        if k := self.count(DIFFERS):
            counts.append(f"{k} differ{'s' if k == 1 else ''} from the download pin")
        detail = f"{n} file{'' if n == 1 else 's'} checked" if n else ""
        if self.count(OK) < n:
            detail += ": " + ", ".join(counts)
        if k := sum(c.status == OK and c.pin == DIFFERS for c in self.checks):
            detail += f" ({k} not the pinned download; SHA256SUMS vouches for {'it' if k == 1 else 'them'})"
        if self.unchecked:
            detail += (f"; {self.unchecked} unchecked (in no {SUMS})" if n else
                       f"{self.unchecked} file{'' if self.unchecked == 1 else 's'} in no {SUMS}")
        if not self.found:
            detail += "; dataset not found"
        return f"{word:9s} {detail}"


@dataclass
class Report:
    sums: list[SumsFile]
    datasets: list[DatasetReport]
    unclaimed: list[Entry]  # entries that name no dataset's file: not checked
    roots: list[Path]

    @property
    def failed(self) -> bool:
        return any(s.problems for s in self.sums) or any(d.failures for d in self.datasets)

    def summary(self) -> list[str]:
        """The lines for stdout: what was checked against what, then one verdict per dataset."""
        datasets = self.datasets
        if not self.sums:  # one line, then only what a registry pin checked
            datasets = [d for d in datasets if d.checks]
            lines = [f"verify: no {SUMS} in {', '.join(map(str, self.roots))} or their dataset folders: "
                     "nothing checked against checksum files" + ("; registry pins:" if datasets else "")]
        else:
            lines = [f"verify: SHA-256 against {', '.join(str(s.path) for s in self.sums)}"]
        lines += [f"{d.name:18s} {d.verdict()}" for d in datasets]
        if self.unclaimed:
            names = ", ".join(str(e.path) for e in self.unclaimed[:3])
            more = f" and {len(self.unclaimed) - 3} more" if len(self.unclaimed) > 3 else ""
            lines.append(f"verify: {len(self.unclaimed)} entr{'y names' if len(self.unclaimed) == 1 else 'ies name'} "
                         f"no dataset's file, not checked: {names}{more}")
        return lines

    def problems(self) -> list[str]:
        """One line per malformed/unreadable SHA256SUMS, failed file and pin warning (for stderr)."""
        out = [p for s in self.sums for p in s.problems]
        out += [c.message() for d in self.datasets for c in d.checks if c.status in (*FAILED, DIFFERS)]
        return out


def _claims(spec: DatasetSpec) -> Callable[[str], bool]:
    """Does a data-directory-relative POSIX path name a file of ``spec``?"""
    if spec.folder not in (".", ""):
        prefix = spec.folder.rstrip("/") + "/"
        return lambda key: key.startswith(prefix)
    names = {f for layout in spec.layouts for f in layout.files} | {s.filename for s in spec.downloads}
    dirs = tuple(n for n in names if n.endswith("/"))
    return lambda key: key in names or key.startswith(dirs)


def _layout_files(folder: Path, files: Iterable[str]) -> list[Path]:
    out = []
    for f in files:
        if f.endswith("/"):
            for dirpath, _, names in os.walk(folder / f):
                out += [Path(dirpath) / n for n in names]
        else:
            out.append(folder / f)
    return out


def _sha256(path: Path, advance: Callable[[int], object]) -> str:
    digest = hashlib.sha256()
    if path.exists() and not path.is_file():  # a FIFO or a device would block or never end
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
            advance(len(chunk))
    return digest.hexdigest()


def verify(specs: Iterable[DatasetSpec] | None = None, progress: bool = False) -> Report:
    """Verify every dataset on the search path (``specs``: all registered ones) and return the findings."""
    from .registry import REGISTRY, _ensure_loaded, find_layout

    if specs is None:
        _ensure_loaded()
        specs = [REGISTRY[n] for n in sorted({s.name for s in REGISTRY.values()})]
    # a variant reads its parent's files: verify the parent instead, once
    parents = (REGISTRY[v.variant_of] if v.variant_of else v for v in specs)
    parents = (REGISTRY[p] for s in parents for p in (s.parts or (s.name,)))  # a composite: its parts
    specs = list({p.name: p for p in parents}.values())
    specs = [s for s in specs if not s.builtin]
    roots, seen = [], set()
    for root in data_dirs():
        if root.resolve() not in seen:
            seen.add(root.resolve())
            roots.append(root)

    # 1. every SHA256SUMS, its entries keyed by their path relative to the data directory
    sums: list[SumsFile] = []
    keyed: list[tuple[str, Entry]] = []
    folders = sorted({s.folder for s in specs if s.folder not in (".", "")})
    for root in roots:
        for candidate in [root / SUMS] + [root / f / SUMS for f in folders]:
            if candidate.is_file():
                sums.append(parse_sums(candidate))
                for e in sums[-1].entries:
                    keyed.append((Path(os.path.relpath(e.path, root)).as_posix(), e))

    # 2. per dataset: the entries that name its files, its found layout's files, its pinned downloads
    plans = []
    claimed: set[int] = set()
    for spec in specs:
        entries: dict[Path, list[Entry]] = {}
        claims = _claims(spec)
        for i, (key, e) in enumerate(keyed):
            if not key.startswith("../") and claims(key):
                entries.setdefault(e.path, []).append(e)
                claimed.add(i)
        found = find_layout(spec)
        own, pins = [], {}
        if found:
            layout, folder = found
            own = _layout_files(folder, layout.files)
            pins = {folder / s.filename: s.sha256.lower() for s in spec.downloads
                    if s.sha256 and (folder / s.filename).is_file()}
        if found or entries:
            plans.append((spec.name, bool(found), entries, own, pins))

    # 3. hash each file once, in chunks
    wanted = sorted({p for _, _, entries, _, pins in plans for p in (*entries, *pins)})
    sizes = {}
    for p in wanted:
        try:
            sizes[p] = p.stat().st_size
        except OSError:
            pass
    bar = None
    if progress and sizes:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, unit_divisor=1024, desc="sha256",
                   disable=None, leave=False, dynamic_ncols=True)
    hashes: dict[Path, str | OSError] = {}
    try:
        for p in wanted:
            try:
                hashes[p] = _sha256(p, bar.update if bar else lambda n: None)
            except OSError as exc:
                hashes[p] = exc
    finally:
        if bar:
            bar.close()

    # 4. verdicts
    reports = []
    for name, found, entries, own, pins in plans:
        report = DatasetReport(name, found)
        for path in sorted({*entries, *pins}):
            got = hashes[path]
            if isinstance(got, FileNotFoundError):
                check = FileCheck(path, MISSING, source=entries[path][0].where if path in entries else "")
            elif isinstance(got, OSError):
                check = FileCheck(path, UNREADABLE, error=got.strerror or type(got).__name__)
            elif path in entries:
                wrong = [e for e in entries[path] if e.sha256 != got]
                e = wrong[0] if wrong else entries[path][0]
                check = FileCheck(path, BAD if wrong else OK, got, e.sha256, e.where)
                if path in pins:
                    check.pin = OK if pins[path] == got else DIFFERS
            else:
                check = FileCheck(path, OK if pins[path] == got else DIFFERS, got, pins[path], "registry pin")
            if check.status == MISSING and path not in entries:
                continue  # a pinned download that vanished since find_layout looked: downloads are optional
            report.checks.append(check)
        report.unchecked = len({*own} - {*entries, *pins})
        reports.append(report)
    unclaimed = [e for i, (_, e) in enumerate(keyed) if i not in claimed]
    return Report(sums, reports, unclaimed, roots)
