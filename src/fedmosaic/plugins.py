"""Plug-ins: modules that register datasets, models and algorithms (``register_dataset``, ``register_model``,
``register_algorithm``) when imported, so that the command line sees what a Python script registered.

A plug-in is loaded by ``fedmosaic --plugin MODULE`` (repeatable), by ``$FEDMOSAIC_PLUGINS`` (module names separated
by commas or ``os.pathsep``) and by the entry-point group ``fedmosaic.plugins`` of installed packages. Every
registration remembers the module whose code made it; a run records the modules of the names it uses in its
``meta.json`` (``used_by``), so that ``report`` or ``--resume`` of it without them says which ``--plugin`` to pass.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import sys
import warnings
from importlib.metadata import entry_points
from pathlib import Path

from .errors import ConfigError

ENV = "FEDMOSAIC_PLUGINS"
GROUP = "fedmosaic.plugins"

#: (kind, name) -> the module that registered it ("__main__": a script, which no --plugin can load again)
ORIGINS: dict[tuple[str, str], str] = {}
#: the plug-ins that the run directories being read were made with (``expect``), in order
RECORDED: dict[str, None] = {}


def caller() -> str:
    """The module, outside fedmosaic, whose code is registering."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "fedmosaic":
        frame = frame.f_back
    return "__main__" if frame is None else frame.f_globals.get("__name__", "__main__")


#: what a registered dataset's or model's name may be
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def claim(kind: str, name: str, taken: bool, origin: str | None = None) -> None:
    """Record who registers ``name`` (``origin``: that module; by default the calling code's). A built-in name is
    refused, and so is a name another module registered (two plug-ins would silently run whichever was imported
    last); the same module may register it again (a notebook cell run twice, a reloaded module)."""
    origin, before = origin or caller(), ORIGINS.get((kind, name))
    if taken and before is None:
        raise ConfigError(f"register_{kind}({name!r}): a built-in {kind} has that name; choose another")
    if taken and before != origin:
        raise ConfigError(f"register_{kind}({name!r}): already registered by {before}; choose another name")
    ORIGINS[(kind, name)] = origin


def blame(exc: BaseException) -> str | None:
    """Where in a plug-in's code ``exc`` was raised (``file.py:line in function``: the innermost frame of a module
    that registered something), or None when no plug-in code is on its way."""
    tops = {m.partition(".")[0] for m in ORIGINS.values()}
    tb, found = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__", "").partition(".")[0] in tops:
            found = tb
        tb = tb.tb_next
    if found is None:
        return None
    return f"{Path(found.tb_frame.f_code.co_filename).name}:{found.tb_lineno} in {found.tb_frame.f_code.co_name}"


#: installed entry points that could not be imported: what -> the one line saying why (``load``, ``hint``)
BROKEN: dict[str, str] = {}


def load(names: list[str] = ()) -> None:
    """Import the plug-ins ``names`` (``--plugin``), those of ``$FEDMOSAIC_PLUGINS`` and the installed entry points
    of the group ``fedmosaic.plugins``. One that was asked for and cannot be imported is an error, one line naming
    it; an installed entry point that cannot be is a warning, so that a broken package does not stop every command
    (a run that needs a name it registers says, beside "unknown ...", that it did not import)."""
    env = [n.strip() for n in re.split(f"[,{re.escape(os.pathsep)}]", os.environ.get(ENV, "")) if n.strip()]
    for name in dict.fromkeys([*names, *env]):
        if name.endswith(".py") or os.sep in name:
            raise ConfigError(f"plugin {name!r}: give the module's name ({Path(name).stem}), not its file")
        _import(f"plugin {name!r}", lambda n=name: importlib.import_module(n))
    for ep in entry_points(group=GROUP):
        dist = getattr(ep.dist, "name", "an installed package")
        what = f"plugin {ep.value!r} (entry point {ep.name!r} of {dist})"
        try:
            _import(what, ep.load)
        except ConfigError as e:
            if what not in BROKEN:  # once a process (main() called again, a notebook)
                warnings.warn(f"{e}; continuing without it", stacklevel=2)
            BROKEN[what] = str(e)


def _import(what: str, do) -> None:
    try:
        do()
    except SystemExit as e:  # a module that exits while being imported would end fedmosaic with its code (0: "fine")
        raise ConfigError(f"{what}: it called sys.exit({e.code!r}) while being imported; a plug-in registers "
                          "datasets, models or algorithms and returns") from None
    except ConfigError as e:  # a registration it made was refused: that one line, under the plug-in's name
        raise ConfigError(f"{what}: {e}") from None
    except Exception as e:  # whatever the module raises while importing: it is the user's code, named in one line
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"{what}: cannot import it: {type(e).__name__}: {first}") from None


def used_by(cfg) -> list[str]:
    """The modules that registered the datasets, models and algorithms ``cfg`` uses (for the run's meta.json)."""
    names = [("dataset", cfg.data.dataset.lower()), ("model", cfg.model.name),
             *(("model", a.name) for a in cfg.model.heterogeneous or []),
             *(("algorithm", a.name) for a in [cfg.algorithm, *(cfg.compare or [])])]
    if cfg.data.public is not None:
        names.append(("dataset", cfg.data.public.source.lower()))
    return sorted({ORIGINS[n] for n in names if n in ORIGINS})


def expect(dirs: list[Path]) -> None:
    """Note the plug-ins the runs in ``dirs`` (a run, a comparison's variants, its seeds) were made with."""
    for d in dirs:
        for meta in [d / "meta.json", *d.glob("*/meta.json"), *d.glob("*/*/meta.json")]:
            try:
                found = json.loads(meta.read_text()).get("plugins") or []
            except (OSError, ValueError, AttributeError):
                continue  # a damaged meta.json: reading the run says so
            if isinstance(found, list):
                RECORDED.update(dict.fromkeys(m for m in found if isinstance(m, str)))


_in_python = False  # the hints name Result.load's plugins=[...] instead of the CLI's --plugin (``in_python``)


@contextlib.contextmanager
def in_python():
    """Within it, :func:`hint` says how to pass a plug-in to ``Result.load`` rather than on the command line."""
    global _in_python
    before, _in_python = _in_python, True
    try:
        yield
    finally:
        _in_python = before


def hint(kind: str) -> str:
    """What to add to "unknown dataset/model/algorithm": the plug-in the run was made with, or how to pass one;
    first, the installed plug-ins that did not import (the name may be theirs)."""
    broken = "".join(f" ({why})" for why in BROKEN.values())
    return broken + _hint(kind)


def _hint(kind: str) -> str:
    how = (lambda m: f"plugins=[{m}]") if _in_python else (lambda m: f"--plugin {m}")  # noqa: E731
    missing = [m for m in RECORDED if m == "__main__" or m not in sys.modules]
    if "__main__" in missing:
        return (f" (the run was made with a {kind} that a script registered: move its register_{kind} call into a "
                f"module and pass {how('MODULE')})")
    if missing:
        listed = ", ".join(map(repr, missing)) if _in_python else " --plugin ".join(missing)
        return f" (the run was made with plugin {', '.join(missing)}: pass {how(listed)})"
    return f" (registered in Python? pass its module: {how('MODULE')})"
