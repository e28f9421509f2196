"""torch.compile with a way out and a memory.

A compiled function falls back to eager once compiling fails on this machine (one warning). Compiled graphs are kept
between processes in fedmosaic's cache folder (:class:`CompileCache`: torch's own FX-graph and AOTAutograd caches,
whose keys hold the graph, shapes, dtypes, device and compiler settings, under a folder of this torch version), so a
second run of a setting — or the next variant and seed of a comparison — loads its kernels instead of building them.
A manifest of what was written lets a damaged entry be removed before torch reads it (one warning), and a marker per
compiled setting tells ``execution.choose`` that its warm-up will be the short one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import warnings
from pathlib import Path

import torch

from ...files import atomic_write

#: torch's own variable for where inductor keeps its caches: a user's setting wins over fedmosaic's folder
TORCH_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
#: the cache folders this process has verified (once each)
_VERIFIED: set[Path] = set()


def _users_folder() -> str | None:
    """``TORCHINDUCTOR_CACHE_DIR`` as the user set it; torch's own default is not a choice (torch writes it into the
    environment the first time it looks, e.g. while measuring a model on the meta device)."""
    folder = os.environ.get(TORCH_CACHE_ENV)
    if not folder:
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torchs

    return None if os.path.abspath(folder) == os.path.abspath(torchs()) else folder


class CompileCache:
    """torch's compile caches in ``root`` (``<fedmosaic cache>/compile/torch-<version>``), verified once per process
    against the manifest of what was written there; ``warm(key)``: a setting of that key compiled here before."""

    def __init__(self, root: Path):
        self.root, self.manifest = Path(root), Path(root) / "fedmosaic-manifest.json"

    @classmethod
    def default(cls) -> CompileCache:
        from ...paths import default_cache_dir

        return cls(Path(_users_folder() or default_cache_dir() / "compile" / f"torch-{torch.__version__}"))

    def enable(self) -> None:
        """torch's FX-graph and AOTAutograd caches on, in this folder; damaged entries removed (once per process)."""
        import torch._functorch.config
        import torch._inductor.config

        os.environ[TORCH_CACHE_ENV] = str(self.root)
        torch._inductor.config.fx_graph_cache = True
        torch._functorch.config.enable_autograd_cache = True
        if self.root not in _VERIFIED:
            _VERIFIED.add(self.root)
            self.remove_damaged()

    def _files(self) -> dict[str, list]:
        out = {}
        for p in self.root.rglob("*"):
            if p.is_file() and p != self.manifest and not p.name.startswith("."):
                data = p.read_bytes()
                out[str(p.relative_to(self.root))] = [len(data), hashlib.sha256(data).hexdigest()]
        return out

    def _read(self) -> dict:
        try:
            saved = json.loads(self.manifest.read_text())
            return saved if isinstance(saved, dict) and isinstance(saved.get("files"), dict) else {}
        except (OSError, ValueError):
            return {}

    def remove_damaged(self) -> list[str]:
        """Remove every entry whose bytes differ from what the manifest recorded (a write cut short, a disk error,
        an edit), with one warning; entries the manifest does not know are left to torch. A damaged manifest drops
        the folder's entries whole (nothing can be vouched for)."""
        if not self.root.is_dir():
            return []
        saved = self._read()
        if not saved and self.manifest.exists():
            bad = list(self._files())
        else:
            bad = [rel for rel, entry in saved.get("files", {}).items()
                   if self._inside(rel) and (p := self.root / rel).is_file()
                   and [p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()] != entry]
        for rel in bad:
            (self.root / rel).unlink(missing_ok=True)
        if bad:
            warnings.warn(f"engine.compile: {len(bad)} damaged entr{'y' if len(bad) == 1 else 'ies'} of the compile "
                          f"cache {self.root} removed; what they held is compiled again", stacklevel=2)
            self.record()
        return bad

    def _inside(self, rel: str) -> bool:
        """``rel`` names a file inside the folder (a manifest is data: one naming ``../x`` or ``/x`` touches
        nothing)."""
        if not isinstance(rel, str) or Path(rel).is_absolute() or ".." in Path(rel).parts:
            return False
        return (self.root / rel).resolve().is_relative_to(self.root.resolve())

    def record(self, key: str | None = None) -> None:
        """The manifest of every entry now in the folder (and ``key``'s marker: compiled here)."""
        saved = self._read()
        warm = sorted(set(saved.get("warm", [])) | ({key} if key else set()))
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write(self.manifest, json.dumps({"files": self._files(), "warm": warm}).encode())

    def warm(self, key: str) -> bool:
        return key in self._read().get("warm", [])


class CompiledOrEager:
    """``torch.compile(fn)``, or ``fn`` itself once compiling has failed here (no working compiler for this device,
    a GPU Triton cannot target): one warning per trainer (``failed`` is shared by its compiled functions), and the
    run goes on eagerly — the same arithmetic, without the compiled speed. A compile fails before the graph runs,
    so nothing was updated in place and the eager call repeats nothing."""

    def __init__(self, fn, failed: list, compiled_here=None):
        """``compiled_here()``: called after a call that compiled a new graph (the cache has new entries)."""
        from torch._dynamo.utils import counters

        self.fn, self.compiled, self.failed = fn, torch.compile(fn, dynamic=False), failed
        self.compiled_here, self.counters = compiled_here, counters  # (imported once, not at every call)

    def __call__(self, *args):
        if not self.failed:
            try:
                if self.compiled_here is None:
                    return self.compiled(*args)
                before = self.counters["stats"]["unique_graphs"]
                out = self.compiled(*args)
                if self.counters["stats"]["unique_graphs"] != before:
                    self.compiled_here()
                return out
            except Exception as e:
                if not isinstance(e, compile_errors()):
                    raise
                cause = getattr(e, "inner_exception", None) or e
                first = (str(cause).strip().splitlines() or [""])[0][:300]
                self.failed.append(f"{type(cause).__name__}: {first}")
                warnings.warn(f"engine.compile: torch.compile failed on this machine ({self.failed[0]}); training "
                              "goes on without compiling (set engine.compile: false to skip the attempt)",
                              stacklevel=2)
        return self.fn(*args)


@functools.cache
def compile_errors() -> tuple[type, ...]:
    """What torch raises when it cannot compile (as opposed to an error in the code being compiled)."""
    from torch._dynamo.exc import BackendCompilerFailed

    errors: list[type] = [BackendCompilerFailed]
    with contextlib.suppress(ImportError):
        from torch._inductor.exc import InductorError

        errors.append(InductorError)
    return tuple(errors)


