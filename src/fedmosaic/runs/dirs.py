"""Run directories: new ones claimed without overwriting anything, what a resume can continue, and ``meta.json``
(versions, execution, where each metric is computed, amendments, the round a run diverged in)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import sys
import warnings
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from .. import plugins
from ..config import RunConfig, dir_name, dump, load_config, validate
from ..engine.federation import Federation
from ..errors import FedMosaicError
from ..files import atomic_write, is_temp, refuse_dangling, remove_temp_files, set_aside
from ..version import __version__


def refuse_runs_dir(root: Path) -> None:
    """Where new run directories go: refused in one line where none can be made (a file, a dangling link)."""
    refuse_dangling(root, "--runs-dir")
    if root.exists() and not root.is_dir():
        raise FedMosaicError(f"--runs-dir {root} is a file, not a folder; choose another --runs-dir")


def new_run_dir(root: str | Path, name: str) -> Path:
    """A new, empty directory ``<root>/<name>-<time>[-i]``, created here so that runs started at the same moment
    each get their own."""
    refuse_runs_dir(Path(root))
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{name}-{stamp}"
    path, i = base, 1
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        while True:
            try:
                path.mkdir(parents=True)  # (parents: a run that failed at once may have removed root since)
                return path
            except FileExistsError:
                path, i = base.with_name(f"{base.name}-{i}"), i + 1
    except OSError as e:
        raise FedMosaicError(f"cannot create a run directory in {root}: {e.strerror or e}") from None


def cpu_name() -> str:
    """The CPU's model ("AMD EPYC", "Intel(R) Xeon(R) ..."): /proc/cpuinfo's on Linux, where
    ``platform.processor()`` is empty; else platform's, else the architecture."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    return platform.processor() or platform.machine()


def hardware(device: torch.device | str) -> dict:
    """What a run's rounds run on, named: the CPU, its cores and, on a GPU, the GPU's name."""
    device = torch.device(device)
    return {"cpu": cpu_name(), "cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def tasks_hash(tasks: list) -> str:
    """SHA-256 of the clients' task streams (``data.tasks``: per client, per stage, the task, its classes and its
    samples), which the partition's hash does not cover."""
    h = hashlib.sha256()
    for k, stream in enumerate(tasks):
        for j, task in enumerate(stream):
            h.update(f"{k}/{j}:".encode())
            if task is not None:
                h.update(f"{task[0]}:{np.asarray(task[1]).tolist()}:".encode())
                h.update(np.ascontiguousarray(task[2], dtype=np.int64).tobytes())
    return h.hexdigest()


def run_meta(cfg: RunConfig, fed: Federation) -> dict:
    return {
        "fedmosaic": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hardware": hardware(fed.device),  # a resume on another machine adds a "resumed" entry
        "seed": cfg.seed,
        "data_hash": fed.fd.hash,
        **({} if fed.tasks is None else {"tasks_hash": tasks_hash(fed.tasks)}),
        "num_clients": fed.num_clients,
        "device": str(fed.device),
        "execution": executions(fed),
        "metric_sides": fed.metric_sides(),  # where each metric is computed: server, client or simulation only
        "plugins": plugins.used_by(cfg),  # the modules that registered this run's dataset or models
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": cfg.model_dump(mode="json"),  # what the run is: a resume compares config.yaml with it
        **fed.pool.meta(),  # a deployment: its driver, the run's node token, which node hosts which client
    }


def discard(out: Path, created: Path | None) -> None:
    """Remove what a new run wrote into ``out`` before its first round finished (config, meta, empty metrics),
    and the folders it created (``created``: ``first_missing``)."""
    for name in ("config.yaml", "meta.json", "metrics.jsonl"):
        (out / name).unlink(missing_ok=True)
    remove_temp_files(out, out / "checkpoints")
    with contextlib.suppress(OSError):  # not empty: something else is there, keep it
        (out / "checkpoints").rmdir()
    remove_made(out, created)


def first_missing(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist yet (None: ``path`` exists): the folder
    that creating ``path`` makes, so that a start that fails removes what it made, never a folder that was
    there."""
    missing = None
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            break
        missing = p
    return missing


def remove_made(path: Path, top: Path | None) -> None:
    """Remove ``path`` and its parents up to ``top`` (``first_missing``'s), each only while it is empty."""
    for p in (path, *path.parents) if top is not None else ():
        try:
            p.rmdir()
        except OSError:  # not empty (something else is there: keep it) or gone
            return
        if p == top:
            return


def check_out(out: Path, resume: bool, what: str = "run directory") -> None:
    """A run (or comparison) directory is a directory, and a new run's is empty: nothing is ever overwritten. A
    directory that holds nothing but the temporary files of a start that was killed while claiming it (before its
    config was written) is empty: they are removed. ``what``: the folder as the message names it (another than a
    run directory is not offered --resume)."""
    if out.exists() and not out.is_dir():
        raise FedMosaicError(f"{out} exists and is not a directory; choose another --out")
    refuse_dangling(out, "--resume" if resume else "--out")
    if not resume and unclaimed(out):
        remove_temp_files(out)
    if not resume and out.exists() and any(out.iterdir()):
        resume_it = "use --resume to continue it or " if what == "run directory" else ""
        raise FedMosaicError(f"{what} {out} already exists; {resume_it}choose another --out")


#: what a directory holds by the config file it saved, and what a resume expected it to be
_HOLDS = {"config.yaml": "a single run", "comparison.yaml": "a comparison", "seeds.yaml": "several seeds"}
_NOT = {"config.yaml": "one run", "comparison.yaml": "a comparison", "seeds.yaml": "a seeds run"}


def not_a_run(out: Path, expected: str = "config.yaml") -> str:
    """Why ``--resume`` cannot continue ``out``."""
    if unclaimed(out):
        return (f"--resume: {out} never finished starting (it was stopped while writing its config), so there is "
                "nothing to resume; start the run again with --out pointing there")
    held = next((f for f in _HOLDS if f != expected and (out / f).is_file()), None)
    if held and expected in _NOT:  # e.g. --set compare=null on a comparison's resume, --seeds on a run's
        return (f"--resume: {out} holds {_HOLDS[held]} ({held}), not {_NOT[expected]}: a --set or --seeds "
                "cannot make it one; resume it without them, or choose another --out")
    return f"--resume: {out} is not a run directory (no {expected})"


def unclaimed(out: Path) -> bool:
    """``out`` holds only temporary files: a run (or comparison) was killed while writing its config there."""
    found = list(out.iterdir()) if out.is_dir() else []
    return bool(found) and all(is_temp(p) for p in found)


def claim(path: Path, text: str) -> None:
    """Write a new run's config, refusing if another run wrote one there meanwhile (two runs, one --out)."""
    try:
        atomic_write(path, text.encode(), exclusive=True)
    except FileExistsError:
        raise FedMosaicError(f"{path.parent} was taken by another run meanwhile; choose another --out") from None


_HELD: set[str] = set()  # the directories this process holds (a comparison's own runs take their own)


@contextlib.contextmanager
def holding(out: Path):
    """Yields ``take()``: lock the directory ``out`` (it must exist by then) for as long as the ``with`` lasts, so
    that a second process — a resume started while the run still goes on, the same command twice — is refused in
    one line instead of training and writing the same runs at once. An advisory ``flock`` on the directory
    itself: nothing is written, and a process that is killed holds nothing any more."""
    held: list[tuple[int, str]] = []

    def take() -> None:
        key = os.path.realpath(out)
        if held or key in _HELD:
            return
        try:
            fd = os.open(out, os.O_RDONLY)
        except OSError as e:
            raise FedMosaicError(f"cannot open the run directory {out}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise FedMosaicError(f"{out} is in use by another fedmosaic process (a run, comparison or reproduction "
                                 "still going on there); wait for it to end, or choose another --out") from None
        _HELD.add(key)
        held.append((fd, key))

    try:
        yield take
    finally:
        for fd, key in held:
            _HELD.discard(key)
            os.close(fd)


def deployed(out: Path) -> bool:
    """The run in ``out`` was deployed (``meta.json`` names a driver: its clients' state lives on their nodes)."""
    try:
        return bool(json.loads((out / "meta.json").read_text()).get("driver"))
    except (OSError, ValueError, AttributeError):
        return False


def started_threads(out: Path) -> int | None:
    """The CPU threads the run in ``out`` started with (``meta.json``), None where it does not say."""
    try:
        count = json.loads((out / "meta.json").read_text())["execution"][0]["cpu_threads"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    return count if isinstance(count, int) and count > 0 else None


def started_warm(out: Path) -> tuple[bool, ...] | None:
    """Per architecture whether the run in ``out`` started counting on the compile cache's short warm-up
    (``meta.json``; a run recorded before there was a cache counted on the cold one), None without a record."""
    try:
        groups = json.loads((out / "meta.json").read_text())["execution"]
        return tuple(bool(g.get("compile_warm", False)) for g in groups)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def executions(fed: Federation) -> list[dict]:
    """How each architecture group runs (``execution.Execution``), for meta.json."""
    return [{"model": g.module.__class__.__name__, "norm": norm_kind(g.module), "clients": len(g.clients),
             **g.execution.as_dict()} for g in fed.groups]


def norm_kind(module: torch.nn.Module) -> str:
    """Which normalisation a model uses: 'batch' (running statistics: the sequential path), 'group' or 'none'."""
    kinds = {"batch" if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) else "group"
             for m in module.modules() if isinstance(m, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.GroupNorm))}
    return "+".join(sorted(kinds)) or "none"


def read_meta(out: Path) -> dict | None:
    """``meta.json`` as the object the runner writes, or None where it is missing or damaged (JSON that is not an
    object included)."""
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def recorded_config(out: Path) -> tuple[RunConfig, Path]:
    """The config the run in ``out`` recorded (``meta.json``, amendments included) and where: ``config.yaml``
    is the user's to read, and one edited by hand is a change like a ``--set`` (refused without ``--amend``,
    recorded with it), not what the run was. A run recorded before ``meta.json`` held its config:
    ``config.yaml``."""
    raw = (read_meta(out) or {}).get("config")
    if isinstance(raw, dict):
        return validate(raw, f"{out / 'meta.json'}"), out / "meta.json"
    return load_config(out / "config.yaml"), out / "config.yaml"


def record_amendment(out: Path, cfg: RunConfig, changes: dict, start: int, fed: Federation) -> None:
    meta = read_meta(out)
    if meta is None:
        if (out / "meta.json").exists():
            set_aside(out / "meta.json", ".corrupt")
        warnings.warn(f"{out}/meta.json is missing or damaged; a new one records the amendment", stacklevel=2)
        meta = {}
    meta.pop("diverged_round", None)  # (an amended run is not the one that diverged)
    meta.setdefault("amendments", []).append(
        {"from_round": start, "changes": changes, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
         "execution": executions(fed)})
    meta["config"] = cfg.model_dump(mode="json")
    atomic_write(out / "meta.json", json.dumps(meta, indent=2).encode())
    atomic_write(out / "config.yaml", dump(cfg).encode())


def note_resume(out: Path, start: int, fed: Federation) -> None:
    """``meta.json`` records each resume (its first round, when, on what), so that a run whose rounds ran on
    several machines names each of them."""
    meta = read_meta(out)
    if meta is not None:
        meta.setdefault("resumed", []).append({"from_round": start, "hardware": hardware(fed.device),
                                               "time": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        atomic_write(out / "meta.json", json.dumps(meta, indent=2).encode())


def note_divergence(out: Path, t: int) -> None:
    """``meta.json`` records the round a run diverged in (``diverged_round``: tables say so)."""
    meta = read_meta(out)
    if meta is not None:
        atomic_write(out / "meta.json", json.dumps({**meta, "diverged_round": t}, indent=2).encode())


def diverged_round(out: Path) -> int | None:
    """The round the run in ``out`` diverged in, if it did (``meta.json``)."""
    try:
        value = json.loads((out / "meta.json").read_text()).get("diverged_round")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def ended(out: Path) -> bool:
    """A run that finished (its summary written) or diverged (its rounds before are its result)."""
    return (out / "summary.json").is_file() or diverged_round(out) is not None


def variant_dir(where: Path, v: RunConfig, variants: list[RunConfig]) -> Path:
    """The directory of the variant ``v`` of a comparison of ``variants`` in ``where`` (``where`` itself for one)."""
    return where / dir_name(v.name) if len(variants) > 1 else where
