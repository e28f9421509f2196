"""Runs: a run directory with the resolved config, metadata, metrics.jsonl, checkpoints and summary.json.

Nothing a user produced is overwritten: a new run refuses an existing non-empty directory; ``resume`` continues a
directory from its last checkpoint and, because every random choice derives from (seed, round, client), finishes
with exactly the metrics of an uninterrupted run (timing fields aside).
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import platform
import signal
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from .. import __version__, plugins
from ..config import RunConfig, dump, load_config, yaml_scalar
from ..data.federated import FederatedData
from ..errors import ClientsLost, FedMosaicError, RunError
from ..files import TEMP_SUFFIX, atomic_write, remove_temp_files
from ..protocol.tree import layout
from . import robust, stopping, trackers
from .client import NonFiniteLoss
from .continual import continual_summary
from .federation import Federation

TIMING_KEYS = ("time_round_s", "time_eval_s")
KEEP_CHECKPOINTS = 2
#: What ``--amend`` may change when resuming: settings that shape the rounds still to come, not the ones done.
AMENDABLE = ("train.rounds", "train.optimizer.lr", "train.optimizer.lr_decay", "eval", "checkpoint_every", "engine",
             "seeds", "deploy")


def new_run_dir(root: str | Path, name: str) -> Path:
    """A new, empty directory ``<root>/<name>-<time>[-i]``, created here so that runs started at the same moment
    each get their own."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{name}-{stamp}"
    path, i = base, 1
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        while True:
            try:
                path.mkdir()
                return path
            except FileExistsError:
                path, i = base.with_name(f"{base.name}-{i}"), i + 1
    except OSError as e:
        raise FedMosaicError(f"cannot create a run directory in {root}: {e.strerror or e}") from None


def _save_checkpoint(out: Path, fed: Federation, round_done: int) -> Path:
    ck = out / "checkpoints"
    ck.mkdir(exist_ok=True)
    # serialised in memory first: torch's zip writer turns a failed file write (a full disk) into an opaque
    # RuntimeError, while a plain write raises the OSError that says what happened
    buf = io.BytesIO()
    torch.save({"round": round_done, "run": _identity(fed), **fed.state_dict()}, buf)
    path = atomic_write(ck / f"round_{round_done:05d}.pt", buf.getvalue())
    for old in checkpoints(out)[:-KEEP_CHECKPOINTS]:
        old.unlink()
    return path


def _identity(fed: Federation) -> dict:
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
    flat = {k: v for k, v in _flat(cfg.model_dump(mode="json")).items()
            if k != "name" and not any(k == a or k.startswith(a + ".") for a in AMENDABLE)
            and not (k in ADDED_LATER and v == ADDED_LATER[k])}
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()


def checkpoints(out: Path) -> list[Path]:
    """The run's checkpoints, oldest first."""
    return sorted(p for p in (out / "checkpoints").glob("round_*.pt") if p.stem[6:].isdigit())


def latest_checkpoint(out: Path) -> Path | None:
    found = checkpoints(out)
    return found[-1] if found else None


def read_metrics(out: Path) -> list[dict]:
    """The rounds of ``metrics.jsonl``, 0, 1, 2, ... A damaged line (a crash mid-write, a full disk, an edit) ends
    them, with a warning: the rounds from there on count as not done."""
    p = out / "metrics.jsonl"
    if not p.exists():
        return []
    lines = [ln for ln in p.read_text(errors="replace").splitlines() if ln.strip()]
    records: list[dict] = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not _well_formed(rec, records):
            rest = len(lines) - i - 1
            warnings.warn(f"{p}: line {i + 1} is damaged or out of order (a crash while writing?); dropped it"
                          + (f" and the {rest} after it" if rest else "") + f"; rounds from {len(records)} on "
                          "count as not done", stacklevel=2)
            break
        records.append(rec)
    return records


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _numbers(x, n: int | None = None, none: bool = False) -> bool:
    """``x`` is a list of numbers (``none``: or nulls), of length ``n`` when given."""
    return (isinstance(x, list) and (n is None or len(x) == n)
            and all(_number(v) or (none and v is None) for v in x))


def _table(x) -> bool:
    """A flat dict of named numbers (loss terms, an algorithm's report)."""
    return isinstance(x, dict) and all(map(_number, x.values()))


#: What evaluate.client_summary writes for every split of client tests.
_CLIENT_STATS = ("acc", "acc_mean", "acc_std", "acc_worst10", "acc_best10")


def _cross(c) -> bool:
    """The K x K cross-client matrix, its diagonal and off-diagonal means per client and overall, names of rows."""
    if not isinstance(c, dict) or not isinstance(c.get("matrix"), list):
        return False
    K = len(c["matrix"])
    return (K > 0 and all(_numbers(row, K) for row in c["matrix"]) and _numbers(c.get("intra"), K)
            and _numbers(c.get("inter"), K) and _number(c.get("intra_avg")) and _number(c.get("inter_avg"))
            and ("names" not in c or (isinstance(c["names"], list) and len(c["names"]) == K
                                      and all(isinstance(n, str) for n in c["names"]))))


def _continual(c, before: list[dict]) -> bool:
    """Class-incremental accuracy after a round: one entry per stage so far, stages that never go back, and the
    k-th task end at stage k (the rows of the accuracy matrix)."""
    if not (isinstance(c, dict) and isinstance(c.get("stage"), int) and not isinstance(c["stage"], bool)
            and c["stage"] >= 0 and isinstance(c.get("task_end"), bool) and _number(c.get("seen_acc"))
            and _numbers(c.get("tasks"), c["stage"] + 1, none=True)):
        return False
    earlier = [r["continual"] for r in before if "continual" in r]
    ends = sum(e["task_end"] for e in earlier)
    return (not earlier or earlier[-1]["stage"] <= c["stage"]) and (not c["task_end"] or c["stage"] == ends)


def _well_formed(rec, before: list[dict]) -> bool:
    """A metrics line as the runner writes it after the lines ``before``: the next round, and every part that
    summaries, tables and plots read, with the types and sizes they expect."""
    if not isinstance(rec, dict) or rec.get("round") != len(before):
        return False
    if not all(_number(rec.get(k)) for k in ("train_loss", "bytes_up", "bytes_down")):
        return False
    if not all(_number(rec[k]) for k in ("lr", *TIMING_KEYS) if k in rec):
        return False
    for key in ("global_clients", "global_val", "personal", "personal_val"):
        if key in rec and not (isinstance(rec[key], dict) and all(_number(rec[key].get(s)) for s in _CLIENT_STATS)):
            return False
    if "global" in rec:
        g, first = rec["global"], next((r["global"] for r in before if "global" in r), None)
        if not (isinstance(g, dict) and _number(g.get("acc"))
                and _numbers(g.get("class_acc"), None if first is None else len(first["class_acc"]))):
            return False
    return (all(_table(rec[k]) for k in ("terms", "report") if k in rec)
            and ("cross" not in rec or _cross(rec["cross"]))
            and ("continual" not in rec or _continual(rec["continual"], before))
            and ("privacy" not in rec or (isinstance(rec["privacy"], dict) and _number(rec["privacy"].get("delta"))
                                          and (rec["privacy"].get("epsilon") is None
                                               or _number(rec["privacy"]["epsilon"])))))


def _load_checkpoint(path: Path, fed: Federation) -> int:
    """Load ``path`` into ``fed``; the round it ends. Raises ValueError for anything unusable."""
    try:
        state = torch.load(path, weights_only=True, map_location=fed.device)
    except Exception as e:  # torch raises many kinds for a truncated or garbled file
        raise ValueError(f"unreadable ({type(e).__name__})") from None
    if not isinstance(state, dict) or state.get("round") != int(path.stem.split("_")[1]):
        raise ValueError("not a checkpoint of this round")
    state = fed.upgrade(state)  # format 1 (before the server/client split) is converted
    mine = fed.state_dict()
    if any(list(layout(state.get(k))) != list(layout(mine[k])) for k in ("server", "clients")):
        raise ValueError("written for a different model or algorithm")
    ours, theirs = _identity(fed), state.get("run", {})
    if not isinstance(theirs, dict):
        raise ValueError("its run identity is damaged")
    # older checkpoints carry no identity, or no config hash: what they do carry must match
    differ = [k for k in ours if k in theirs and theirs[k] != ours[k]]
    if differ:
        what = {"seed": "seed", "data_hash": "partition", "config": "algorithm, its hyper-parameters or model"}
        raise ValueError(f"written by another run ({', '.join(what[k] for k in differ)} differ)")
    fed.load_state_dict(state)
    return state["round"]


def _restore(out: Path, fed: Federation) -> tuple[int, list[dict]]:
    """Resume point of a (possibly damaged) run directory: the newest checkpoint that loads and whose rounds all
    have their metrics line. Leftover temporary files are removed; unusable checkpoints are set aside (renamed
    ``*.corrupt``), never deleted."""
    remove_temp_files(out, out / "checkpoints")
    records = read_metrics(out)
    start = 0
    for ck in reversed(checkpoints(out)):
        if int(ck.stem.split("_")[1]) >= len(records):
            warnings.warn(f"{ck}: round {ck.stem.split('_')[1]} has no metrics line; resuming from an older "
                          "checkpoint", stacklevel=2)
            continue
        try:
            start = _load_checkpoint(ck, fed) + 1
            break
        except ValueError as e:
            ck.rename(ck.with_name(ck.name + ".corrupt"))
            warnings.warn(f"{ck}: {e}; set aside as {ck.name}.corrupt, resuming from an older checkpoint",
                          stacklevel=2)
    else:
        if records:
            warnings.warn(f"{out}: no usable checkpoint; starting again from round 0", stacklevel=2)
    if len(records) - start > fed.cfg.checkpoint_every:  # more than a crash since the last checkpoint can explain
        backup = out / f"metrics.jsonl.{datetime.now():%Y%m%d-%H%M%S}.bak"
        atomic_write(backup, (out / "metrics.jsonl").read_bytes())
        warnings.warn(f"{out}: rounds {start}-{len(records) - 1} have metrics but no usable checkpoint; they will "
                      f"be recomputed (the metrics as they were are kept in {backup.name})", stacklevel=2)
    records = records[:start]
    atomic_write(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode())
    return start, records


def _flat(d: dict, at: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{at}.{k}" if at else str(k)
        out.update(_flat(v, key) if isinstance(v, dict) and v else {key: v})
    return out


def config_changes(saved: RunConfig, cfg: RunConfig, where: Path, amend: bool) -> dict[str, list]:
    """``{field: [old, new]}`` between a run's saved config and the one it is resumed with. Without ``amend`` any
    change is refused; with it, only the fields in ``AMENDABLE``."""
    old, new = _flat(saved.model_dump(mode="json")), _flat(cfg.model_dump(mode="json"))
    changes = {k: [old.get(k), new.get(k)] for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}
    if not changes:
        return {}
    shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(changes.items())[:3])
    fixed = [k for k in changes if not any(k == a or k.startswith(a + ".") for a in AMENDABLE)]
    if fixed:
        raise FedMosaicError(f"--resume: {fixed[0]} differs from {where} ({shown}) and cannot change in the middle "
                             f"of a run (the rounds already done depend on it); what may change with --amend: "
                             f"{', '.join(AMENDABLE)}")
    if not amend:
        raise FedMosaicError(f"--resume: the config differs from the one saved in {where} ({shown}); add --amend "
                             "to change it from the next round on")
    return changes


def summarize(records: list[dict], cfg: RunConfig) -> dict:
    """Headline numbers. Never "best on test": the best round is chosen on validation accuracy when there is one."""
    ev = [r for r in records if any(k in r for k in ("global", "global_clients", "personal", "continual"))]
    out: dict = {"name": cfg.name, "algorithm": cfg.algorithm.name, "rounds": len(records)}
    for key in ("global", "global_clients", "personal"):
        accs = [r[key]["acc"] for r in ev if key in r]
        if accs:
            out[f"{key}_acc_final"] = accs[-1]
            out[f"{key}_acc_mean"] = float(np.mean(accs))
    for key in ("global_clients", "personal"):  # across clients, in the last evaluated round
        last = ev[-1].get(key) if ev else None
        for stat, name in (("acc_mean", "unweighted"), ("acc_std", "std"), ("acc_worst10", "worst10"),
                           ("acc_best10", "best10")):
            if last is not None and stat in last:
                out[f"{key}_acc_{name}_final"] = last[stat]
    # best-by-validation: the test accuracy in the (first) round with the best validation accuracy
    for val_key, test_key, name in (("global_val", "global", "global_acc_best_by_val"),
                                    ("global_val", "global_clients", "global_clients_acc_best_by_val"),
                                    ("personal_val", "personal", "personal_acc_best_by_val")):
        val = [r for r in ev if val_key in r and test_key in r]
        if val:
            best = max(val, key=lambda r: r[val_key]["acc"])
            out[name] = best[test_key]["acc"]
            out[f"best_round_by_{val_key}"] = best["round"]
    cross = [r["cross"] for r in ev if "cross" in r][-3:]  # AHF's protocol: the mean of the last 3 rounds
    if cross:
        out["intra_last3"] = float(np.mean([c["intra_avg"] for c in cross]))
        out["inter_last3"] = float(np.mean([c["inter_avg"] for c in cross]))
    if ev and "report" in ev[-1]:  # the algorithm's own measures (e.g. sparsity of personal parts)
        out.update({f"{k}_final": v for k, v in ev[-1]["report"].items()})
    ends = [r["continual"] for r in ev if r.get("continual", {}).get("task_end")]
    if ends:  # class-incremental: the accuracy matrix from the evaluations at the end of each task
        T = len(ends)
        a = np.full((T, T), np.nan)
        for i, c in enumerate(ends):
            a[i, : len(c["tasks"])] = [np.nan if v is None else v for v in c["tasks"]]
        cs = continual_summary(a, [c["seen_acc"] for c in ends])
        out.update({"continual_avg": cs["avg_incremental"], "continual_final": cs["seen"][-1],
                    "continual_seen": cs["seen"], "continual_bwt": cs["bwt"],
                    "continual_forgetting": cs["forgetting_mean"],
                    "continual_matrix": [[None if np.isnan(v) else float(v) for v in row] for row in a]})
    terms = [r["terms"] for r in records if "terms" in r]
    if terms:  # the named parts of the local objective: in the last round, and their mean over the rounds
        out["terms_last"] = terms[-1]
        out["terms_mean"] = {n: float(np.mean([t[n] for t in terms if n in t])) for n in terms[-1]}
    history = [r["global"]["class_acc"] for r in ev if "global" in r]
    if len(history) > 1:
        out["forgetting"] = forgetting(history)
    spent = [r["privacy"] for r in records if "privacy" in r]
    if spent:  # client-level DP: the (epsilon, delta) of the whole run
        out["epsilon"], out["delta"] = spent[-1]["epsilon"], spent[-1]["delta"]
    out["bytes_per_round"] = float(np.mean([r["bytes_up"] + r["bytes_down"] for r in records])) if records else 0.0
    out["wall_time_s"] = float(sum(r.get("time_round_s", 0) + r.get("time_eval_s", 0) for r in records))
    return out


def forgetting(class_acc_history: list[list[float]]) -> float:
    """FedNTD eq. 5: F = (1/C) Σ_c max_{t<T} (A_c^t − A_c^T), from the global model's per-class test accuracy."""
    a = np.asarray(class_acc_history)
    return float((a[:-1].max(0) - a[-1]).mean())


def _meta(cfg: RunConfig, fed: Federation) -> dict:
    return {
        "fedmosaic": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "seed": cfg.seed,
        "data_hash": fed.fd.hash,
        "num_clients": fed.num_clients,
        "device": str(fed.device),
        "execution": _executions(fed),
        "metric_sides": fed.metric_sides(),  # where each metric is computed: server, client or simulation only
        "plugins": plugins.used_by(cfg),  # the modules that registered this run's dataset or models
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **fed.pool.meta(),  # a deployment: its driver, the run's node token, which node hosts which client
    }


def run(cfg: RunConfig, out: str | Path, *, resume: bool = False, amend: bool = False, progress: bool = True,
        stop_after: int | None = None, fd: FederatedData | None = None, pool=None) -> dict:
    """Run (or resume) ``cfg`` in directory ``out``. ``stop_after``: stop once that round is done (as if killed).

    With ``resume`` and ``amend``, ``cfg`` may differ from the saved config in the fields of ``AMENDABLE`` (a smaller
    learning rate after a divergence, more rounds); the change applies from the resumed round on and is recorded
    in ``meta.json`` under ``amendments``. ``pool``: where the clients run (``Federation``'s argument; default
    ``engine.pool``).
    """
    out = Path(out)
    check_out(out, resume)
    changes: dict = {}
    if (out / "checkpoints").exists() and not (out / "checkpoints").is_dir():
        raise FedMosaicError(f"{out / 'checkpoints'} is not a directory; move it aside")
    if resume:
        if not (out / "config.yaml").is_file():
            raise FedMosaicError(not_a_run(out))
        changes = config_changes(load_config(out / "config.yaml"), cfg, out / "config.yaml", amend)
    trackers.check(trackers.wanted(cfg))
    # before creating anything: a config or data error leaves no empty run directory
    fed = Federation(cfg, fd, _started_threads(out) if resume else None, pool)
    print(f"fedmosaic: execution: {fed.execution}", flush=True)  # stdout: stderr is for warnings and errors
    created, claimed = not out.exists(), False
    if resume and _deployed(out) and not getattr(fed.pool, "remote", False):  # its clients' state is on its nodes
        raise FedMosaicError(f"--resume: {out} is a deployed run (its clients' state is on their Flower nodes): "
                             "resume it with its deployment's `flwr run ... --run-config 'resume=true'`")
    try:
        out.mkdir(parents=True, exist_ok=True)
        if resume:
            start, records = _restore(out, fed)
            if not (out / "meta.json").exists():  # stopped between claiming the directory and writing meta.json
                atomic_write(out / "meta.json", json.dumps(_meta(cfg, fed), indent=2).encode())
            if cfg.train.rounds < start:
                raise FedMosaicError(f"--amend: train.rounds must be >= the {start} rounds already finished in {out} "
                                     f"(got {cfg.train.rounds})")
            if changes:
                _amend(out, cfg, changes, start, fed)
        else:
            start, records = 0, []
            claim(out / "config.yaml", dump(cfg))
            claimed = True
            atomic_write(out / "meta.json", json.dumps(_meta(cfg, fed), indent=2).encode())
    except OSError as e:
        if claimed:  # nothing of value yet: leave no half-made run directory
            (out / "config.yaml").unlink(missing_ok=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise FedMosaicError(f"cannot write the run directory {out}: {e.strerror or e}") from None
    try:
        lost = 0
        while True:
            try:
                summary = _rounds(cfg, out, fed, start, records, progress, stop_after)
                break
            except ClientsLost as e:  # with their actors: replay from the last checkpoint on new ones
                lost += 1
                if lost > cfg.engine.ray.restarts:
                    raise RunError(f"{e}; stopped after {lost - 1} replays (engine.ray.restarts)") from None
                warnings.warn(f"{e}; replaying from the last checkpoint on new actors", stacklevel=2)
                fed.pool.close()
                fed = Federation(cfg, fed.fd, fed.threads.count, pool)
                start, records = _restore(out, fed)
    except BaseException as e:
        done = len(read_metrics(out))
        if not resume and not done:  # stopped before its first round finished: nothing of value, leave nothing
            _discard(out, created)
        if isinstance(e, OSError):
            raise RunError(f"cannot write {e.filename or out}: {e.strerror or e}; {out} keeps rounds 0-{done - 1}"
                           if done else f"cannot write {e.filename or out}: {e.strerror or e}") from None
        raise
    finally:
        fed.pool.close()
    return summary


def _discard(out: Path, created: bool) -> None:
    """Remove what a new run wrote into ``out`` before its first round finished (config, meta, empty metrics)."""
    for name in ("config.yaml", "meta.json", "metrics.jsonl"):
        (out / name).unlink(missing_ok=True)
    remove_temp_files(out, out / "checkpoints")
    for d in (out / "checkpoints", out) if created else (out / "checkpoints",):
        with contextlib.suppress(OSError):  # not empty: something else is there, keep it
            d.rmdir()


def check_out(out: Path, resume: bool) -> None:
    """A run (or comparison) directory is a directory, and a new run's is empty: nothing is ever overwritten. A
    directory that holds nothing but the temporary files of a start that was killed while claiming it (before its
    config was written) is empty: they are removed."""
    if out.exists() and not out.is_dir():
        raise FedMosaicError(f"{out} exists and is not a directory; choose another --out")
    if not resume and unclaimed(out):
        remove_temp_files(out)
    if not resume and out.exists() and any(out.iterdir()):
        raise FedMosaicError(f"run directory {out} already exists; use --resume to continue it or choose another --out")


def not_a_run(out: Path, expected: str = "config.yaml") -> str:
    """Why ``--resume`` cannot continue ``out``."""
    if unclaimed(out):
        return (f"--resume: {out} never finished starting (it was stopped while writing its config), so there is "
                "nothing to resume; start the run again with --out pointing there")
    return f"--resume: {out} is not a run directory (no {expected})"


def unclaimed(out: Path) -> bool:
    """``out`` holds only temporary files: a run (or comparison) was killed while writing its config there."""
    found = list(out.iterdir()) if out.is_dir() else []
    return bool(found) and all(p.is_file() and p.name.startswith(".") and p.name.endswith(TEMP_SUFFIX) for p in found)


def claim(path: Path, text: str) -> None:
    """Write a new run's config, refusing if another run wrote one there meanwhile (two runs, one --out)."""
    try:
        atomic_write(path, text.encode(), exclusive=True)
    except FileExistsError:
        raise FedMosaicError(f"{path.parent} was taken by another run meanwhile; choose another --out") from None


def _deployed(out: Path) -> bool:
    """The run in ``out`` was deployed (``meta.json`` names a driver: its clients' state lives on their nodes)."""
    try:
        return bool(json.loads((out / "meta.json").read_text()).get("driver"))
    except (OSError, ValueError, AttributeError):
        return False


def _started_threads(out: Path) -> int | None:
    """The CPU threads the run in ``out`` started with (``meta.json``), None where it does not say."""
    try:
        count = json.loads((out / "meta.json").read_text())["execution"][0]["cpu_threads"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    return count if isinstance(count, int) and count > 0 else None


def _executions(fed: Federation) -> list[dict]:
    """How each architecture group runs (``execution.Execution``), for meta.json."""
    return [{"model": g.module.__class__.__name__, "norm": norm_kind(g.module), "clients": len(g.clients),
             **g.execution.as_dict()} for g in fed.groups]


def norm_kind(module: torch.nn.Module) -> str:
    """Which normalisation a model uses: 'batch' (running statistics: the sequential path), 'group' or 'none'."""
    kinds = {"batch" if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) else "group"
             for m in module.modules() if isinstance(m, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.GroupNorm))}
    return "+".join(sorted(kinds)) or "none"


def _amend(out: Path, cfg: RunConfig, changes: dict, start: int, fed: Federation) -> None:
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        if (out / "meta.json").exists():
            (out / "meta.json").rename(out / "meta.json.corrupt")
        warnings.warn(f"{out}/meta.json is missing or damaged; a new one records the amendment", stacklevel=2)
        meta = {}
    meta.pop("diverged_round", None)  # (an amended run is not the one that diverged)
    meta.setdefault("amendments", []).append(
        {"from_round": start, "changes": changes, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
         "execution": _executions(fed)})
    atomic_write(out / "meta.json", json.dumps(meta, indent=2).encode())
    atomic_write(out / "config.yaml", dump(cfg).encode())


def _note_divergence(out: Path, t: int) -> None:
    """``meta.json`` records the round a run diverged in (``diverged_round``: tables say so)."""
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return
    atomic_write(out / "meta.json", json.dumps({**meta, "diverged_round": t}, indent=2).encode())


def diverged_round(out: Path) -> int | None:
    """The round the run in ``out`` diverged in, if it did (``meta.json``)."""
    try:
        value = json.loads((out / "meta.json").read_text()).get("diverged_round")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _rounds(cfg: RunConfig, out: Path, fed: Federation, start: int, records: list[dict], progress: bool,
            stop_after: int | None) -> dict:
    rounds = cfg.train.rounds
    bar = _progress(range(start, rounds), cfg.name, progress, start, rounds)
    track = trackers.Trackers(cfg, out, start, _flat(cfg.model_dump(mode="json"))) if trackers.wanted(cfg) else None
    summary = None
    try:
        with open(out / "metrics.jsonl", "a") as metrics, _stop_between_rounds() as stop:
            for t in bar:
                if _over_budget(cfg, fed, t):
                    last = latest_checkpoint(out)
                    if t > 0 and (last is None or int(last.stem[6:]) != t - 1):
                        _save_checkpoint(out, fed, t - 1)
                        write_csv(out / "metrics.csv", records)
                    break
                t0 = time.perf_counter()
                try:
                    rec = fed.round(t)
                except NonFiniteLoss as e:
                    last = latest_checkpoint(out)
                    if last is None or int(last.stem.split("_")[1]) != t - 1:
                        last = _save_checkpoint(out, fed, t - 1) if t > 0 else None
                    lr = cfg.train.optimizer.lr_at(t)
                    where = f"after round {t - 1}, whose state is saved" if last else "in the first round"
                    smaller = float(f"{cfg.train.optimizer.lr / 10:.3g}")
                    _note_divergence(out, t)
                    raise RunError(f"{e} (learning rate {lr:g}); stopped {where}",
                                   amend=f"train.optimizer.lr={yaml_scalar(smaller)}", diverged=t) from None
                rec["time_round_s"] = time.perf_counter() - t0
                if (t + 1) % cfg.eval.every == 0 or t == rounds - 1 or fed.task_ends(t):
                    t1 = time.perf_counter()
                    rec.update(fed.evaluate(t))
                    rec["time_eval_s"] = time.perf_counter() - t1
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
                records.append(rec)
                if track is not None:  # step = rounds done
                    track.log(scalars(rec, "/"), t + 1)
                if (t + 1) % cfg.checkpoint_every == 0 or t == rounds - 1 or stop.asked:
                    _save_checkpoint(out, fed, t)
                    write_csv(out / "metrics.csv", records)
                stop.now()  # a stop asked during the round: it is saved, stop here
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(_postfix(rec), refresh=False)
                if stop_after is not None and t >= stop_after:
                    return {}
        summary = summarize(records, cfg)
        atomic_write(out / "summary.json", json.dumps(summary, indent=2).encode())
        return summary
    finally:
        if track is not None:  # (a run that stops unfinished closes them as such)
            track.close(None if summary is None else scalars(summary, "/"))


def _over_budget(cfg: RunConfig, fed: Federation, t: int) -> bool:
    """``privacy.max_epsilon``: round ``t`` would spend more (then one warning, and the run ends before it)."""
    p = cfg.privacy
    if p is None or p.max_epsilon is None:
        return False
    eps = robust.epsilon(cfg, t + 1, fed.num_clients)
    if eps <= p.max_epsilon:
        return False
    warnings.warn(f"privacy: round {t} would bring epsilon to {eps:.4g} > max_epsilon {p.max_epsilon:g} (delta "
                  f"{p.delta:g}); the run ends after round {t - 1}" if t else
                  f"privacy: the first round alone would spend epsilon {eps:.4g} > max_epsilon {p.max_epsilon:g}; "
                  "no round ran", stacklevel=2)
    return True


def scalars(rec: dict, sep: str = ".", at: str = "") -> dict[str, float]:
    """The numbers of a metrics record by their path (``global.acc``, ``continual.tasks.0``, ``terms.kd``); the
    per-class accuracies and the cross-client matrix are left out (too wide for one row)."""
    out: dict[str, float] = {}
    items = rec.items() if isinstance(rec, dict) else enumerate(rec)
    for k, v in items:
        key = f"{at}{sep}{k}" if at else str(k)
        if k in ("class_acc", "matrix", "names", "intra", "inter"):
            continue
        if isinstance(v, (dict, list)):
            out.update(scalars(v, sep, key))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = v
    return out


def write_csv(path: Path, records: list[dict]) -> Path:
    """metrics.jsonl as a table, one row per round (``scalars``), for spreadsheets and pandas."""
    rows = [scalars(r) for r in records]
    cols = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, cols, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return atomic_write(path, buf.getvalue().encode())


class _Stop:
    def __init__(self):
        self.asked: int | None = None  # the signal that asked to stop
        self.handlers: dict = {}  # the handlers in place before the run, by signal

    def now(self) -> None:
        if self.asked is not None:
            _raise_as(self.handlers[self.asked], self.asked)


def _raise_as(handler, signum: int) -> None:
    """What the handler in place before the run would have done (the CLI's: unwind as an interrupt)."""
    if callable(handler):
        handler(signum, None)
    raise KeyboardInterrupt


@contextlib.contextmanager
def _stop_between_rounds():
    """Ctrl-C or SIGTERM during a round lets the round finish and be saved (checkpoint included), then stops, so a
    resume continues from there; a round not done ``stopping.GRACE_S`` seconds later stops at its next training
    step, unfinished, and so does a second signal at once (a resume then repeats the rounds since the last
    checkpoint). Outside the main thread signals are left alone."""
    stop = _Stop()

    def handler(signum, frame):
        if stop.asked is not None:
            _raise_as(stop.handlers[signum], signum)
        stop.asked = signum
        stopping.arm(lambda: _raise_as(stop.handlers[signum], signum))
        print(f"\nfedmosaic: note: {signal.Signals(signum).name}: stopping after this round, once it is saved; "
              f"if it takes more than {stopping.GRACE_S:g} s, at its next step, unfinished (again to stop now)",
              file=sys.stderr, flush=True)

    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            stop.handlers[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread
        pass
    try:
        yield stop
    finally:
        stopping.disarm()
        for sig, previous in stop.handlers.items():
            signal.signal(sig, previous)


def _postfix(rec: dict) -> dict:
    post = {"loss": f"{rec['train_loss']:.3f}"}
    for key in ("global", "personal"):
        if key in rec:
            post[f"acc_{key[0]}"] = f"{rec[key]['acc']:.3f}"
    return post


def _progress(it, name, enabled, start, total):
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=name, initial=start, total=total, unit="round", dynamic_ncols=True)
