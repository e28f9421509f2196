"""Checkpoints of a run directory: written atomically, kept two deep, loaded only into the run that wrote them
(its seed, partition and config hash: ``identity``), a damaged one set aside, never deleted (``restore``); and what
``--resume --amend`` may change (``AMENDABLE``)."""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from datetime import datetime
from pathlib import Path

import torch

from ..config import RunConfig
from ..engine.federation import Federation
from ..errors import FedMosaicError
from ..files import atomic_write, remove_temp_files, set_aside
from ..protocol.tree import layout
from .dirs import read_meta
from .records import (
    read_metrics,
)

KEEP_CHECKPOINTS = 2


#: What ``--amend`` may change when resuming: settings that shape the rounds still to come, not the ones done.
AMENDABLE = ("train.rounds", "train.optimizer.lr", "train.optimizer.lr_decay", "eval", "checkpoint_every", "engine",
             "seeds", "deploy")


def save_checkpoint(out: Path, fed: Federation, round_done: int) -> Path:
    ck = out / "checkpoints"
    ck.mkdir(exist_ok=True)
    # serialised in memory first: torch's zip writer turns a failed file write (a full disk) into an opaque
    # RuntimeError, while a plain write raises the OSError that says what happened
    buf = io.BytesIO()
    torch.save({"round": round_done, "run": identity(fed), **fed.state_dict()}, buf)
    path = atomic_write(ck / f"round_{round_done:05d}.pt", buf.getvalue())
    for old in checkpoints(out)[:-KEEP_CHECKPOINTS]:
        old.unlink()
    return path


def identity(fed: Federation) -> dict:
    """What makes a checkpoint belong to a run beyond its tensor layout: the seed, the partition and the hash of
    everything else that shapes the rounds done (``run_hash``)."""
    return {"seed": fed.cfg.seed, "data_hash": fed.fd.hash, "config": run_hash(fed.cfg)}


#: settings added after runs were made, with the value that means "as before": left out of the hash at that value,
#: so those runs' checkpoints still resume
ADDED_LATER = {"aggregation": None, "attack": None, "privacy": None, "privacy.mode": "central", "participation": None}


def run_hash(cfg: RunConfig) -> str:
    """SHA-256 of the resolved config without what may differ between the run and its resume: the fields of
    ``AMENDABLE`` and the name (a label). Two runs with the same hash compute the same rounds: an AHF checkpoint
    never loads into a FedMD run of the same seed and partition, nor a FedProx one into another mu."""
    return config_hash(cfg, ("name", *AMENDABLE))


def config_hash(cfg: RunConfig, without: tuple[str, ...]) -> str:
    """SHA-256 of the resolved config without the fields under ``without`` (dotted prefixes), and without the
    sections added later at their defaults (a run saved before they existed hashes as it did)."""
    fields = {k: v for k, v in flat(cfg.model_dump(mode="json")).items()
              if not any(k == a or k.startswith(a + ".") for a in without)
              and not (k in ADDED_LATER and v == ADDED_LATER[k])}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def checkpoints(out: Path) -> list[Path]:
    """The run's checkpoints, oldest first."""
    return sorted(p for p in (out / "checkpoints").glob("round_*.pt") if p.stem[6:].isdigit())


def latest_checkpoint(out: Path) -> Path | None:
    found = checkpoints(out)
    return found[-1] if found else None


class NotThisRun(ValueError):
    """A checkpoint that loads, but of another seed, partition, model or algorithm than the run being resumed."""

    why = ("the data, model or algorithm this run was made with has changed since (a plug-in? the dataset's "
           "files?)")


class NoIdentity(NotThisRun):
    """A checkpoint of today's format without its run identity: nothing says it is this run's."""

    why = "fedmosaic writes one into every checkpoint of this format, so they were altered or made elsewhere"


def load_checkpoint(path: Path, fed: Federation) -> int:
    """Load ``path`` into ``fed``; the round it ends. Raises ValueError for anything unusable."""
    try:
        state = torch.load(path, weights_only=True, map_location=fed.device)
    except Exception as e:  # torch raises many kinds for a truncated or garbled file
        raise ValueError(f"unreadable ({type(e).__name__})") from None
    if not isinstance(state, dict) or state.get("round") != int(path.stem.split("_")[1]):
        raise ValueError("not a checkpoint of this round")
    older = state.get("format", 1) == 1  # format 1 (before the server/client split): converted
    state = fed.upgrade(state)
    mine = fed.state_dict()
    if any(list(layout(state.get(k))) != list(layout(mine[k])) for k in ("server", "clients")):
        raise NotThisRun("written for a different model or algorithm")
    ours, theirs = identity(fed), state.get("run", {})
    if not isinstance(theirs, dict):
        raise ValueError("its run identity is damaged")
    if not older and ours.keys() - theirs.keys():  # every format-2 checkpoint was written with all of it
        missing = ", ".join(k for k in ours if k not in theirs)
        raise NoIdentity(f"written without a run identity (no {missing})")
    # format 1 may carry no identity, or no config hash (written before them): what it carries must match
    differ = [k for k in ours if k in theirs and theirs[k] != ours[k]]
    if differ:
        what = {"seed": "seed", "data_hash": "partition", "config": "algorithm, its hyper-parameters or model"}
        raise NotThisRun(f"written by another run ({', '.join(what[k] for k in differ)} differ)")
    fed.load_state_dict(state)
    return state["round"]


def restore(out: Path, fed: Federation) -> tuple[int, list[dict]]:
    """Resume point of a (possibly damaged) run directory: the newest checkpoint that loads and whose rounds all
    have their metrics line; a finished run (its summary written, a metrics line for every round) needs none.
    Leftover temporary files are removed; unusable checkpoints are set aside (renamed ``*.corrupt``), never
    deleted. When none is usable and some were of another run (``NotThisRun``: the data, a plug-in's model or the
    code changed since, rather than a stray copy beside the run's own), nothing is touched and the resume is refused
    in one line: starting again would recompute the run on something else under its old metrics."""
    remove_temp_files(out, out / "checkpoints")
    records = read_metrics(out)
    start, unusable = 0, []
    for ck in reversed(checkpoints(out)):
        if int(ck.stem.split("_")[1]) >= len(records):
            warnings.warn(f"{ck}: round {ck.stem.split('_')[1]} has no metrics line; resuming from an older "
                          "checkpoint", stacklevel=2)
            continue
        try:
            start = load_checkpoint(ck, fed) + 1
            break
        except ValueError as e:
            unusable.append((ck, e))
    else:
        if records and len(records) >= fed.cfg.train.rounds and (out / "summary.json").is_file():
            # finished, its checkpoints removed since (to save disk, or kept elsewhere without them): the metrics
            # are its result and nothing is left to run; recomputing it from round 0 would only cost its time
            return len(records), records
        ck, other = next(((ck, e) for ck, e in unusable if isinstance(e, NotThisRun)), (None, None))
        if other is not None:
            raise FedMosaicError(f"{out}: cannot resume: its checkpoints were {other}, {ck.relative_to(out)} "
                                 f"the newest — {other.why}; restore them, or start a new run with another "
                                 "--out")
        if records:
            warnings.warn(f"{out}: no usable checkpoint; starting again from round 0", stacklevel=2)
    amended = [a.get("from_round") for a in (read_meta(out) or {}).get("amendments", []) if isinstance(a, dict)]
    later = min((r for r in amended if isinstance(r, int) and r > start), default=None)
    if later is not None:  # (the config now is the amended one: it would recompute rounds that ran before it)
        raise FedMosaicError(f"{out}: cannot resume from round {start}: its config was amended from round {later} "
                             f"on (meta.json), so rounds {start}-{later - 1} would be recomputed with the amended "
                             f"config over their recorded metrics; restore a checkpoint of round {later - 1} or "
                             "later, or start a new run with another --out")
    for ck, e in unusable:
        aside = set_aside(ck, ".corrupt")
        warnings.warn(f"{ck}: {e}; set aside as {aside.name}, resuming from an older checkpoint", stacklevel=2)
    if len(records) - start > fed.cfg.checkpoint_every:  # more than a crash since the last checkpoint can explain
        backup = set_aside(out / f"metrics.jsonl.{datetime.now():%Y%m%d-%H%M%S}", ".bak",
                           (out / "metrics.jsonl").read_bytes())
        warnings.warn(f"{out}: rounds {start}-{len(records) - 1} have metrics but no usable checkpoint; they will "
                      f"be recomputed (the metrics as they were are kept in {backup.name})", stacklevel=2)
    records = records[:start]
    text = "".join(json.dumps(r) + "\n" for r in records).encode()
    # (only what changes is written: a finished run's metrics stay untouched by a resume that has nothing to do)
    if not (out / "metrics.jsonl").is_file() or (out / "metrics.jsonl").read_bytes() != text:
        atomic_write(out / "metrics.jsonl", text)
    return start, records


def flat(d: dict, at: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{at}.{k}" if at else str(k)
        out.update(flat(v, key) if isinstance(v, dict) and v else {key: v})
    return out


def config_diff(saved: RunConfig, cfg: RunConfig) -> dict[str, list]:
    """``{field: [old, new]}`` for each dotted field that differs between two configs, sorted."""
    old, new = flat(saved.model_dump(mode="json")), flat(cfg.model_dump(mode="json"))
    return {k: [old.get(k), new.get(k)] for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}


def shown_diff(changes: dict[str, list]) -> str:
    """The first three changes of ``config_diff``, for a one-line message."""
    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(changes.items())[:3])


def config_changes(saved: RunConfig, cfg: RunConfig, where: Path, amend: bool) -> dict[str, list]:
    """``{field: [old, new]}`` between a run's saved config and the one it is resumed with. Without ``amend`` any
    change is refused; with it, only the fields in ``AMENDABLE``."""
    changes = config_diff(saved, cfg)
    if not changes:
        return {}
    shown = shown_diff(changes)
    fixed = [k for k in changes if not any(k == a or k.startswith(a + ".") for a in AMENDABLE)]
    if fixed:
        raise FedMosaicError(f"--resume: {fixed[0]} differs from {where} ({shown}) and cannot change in the middle "
                             f"of a run (the rounds already done depend on it); what may change with --amend: "
                             f"{', '.join(AMENDABLE)}")
    if not amend:
        raise FedMosaicError(f"--resume: the config differs from the one saved in {where} ({shown}); add --amend "
                             "to change it from the next round on")
    return changes


