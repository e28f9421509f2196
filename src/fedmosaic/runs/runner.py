"""Runs: a run directory with the resolved config, metadata, metrics.jsonl, checkpoints and summary.json.

Nothing a user produced is overwritten: a new run refuses an existing non-empty directory; ``resume`` continues a
directory from its last checkpoint and, because every random choice derives from (seed, round, client), finishes
with exactly the metrics of an uninterrupted run (timing fields aside).
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

from ..config import RunConfig, dump, yaml_scalar
from ..data.federated import FederatedData
from ..engine import accounting
from ..engine.client.runtime import NonFiniteLoss
from ..engine.federation import Federation
from ..errors import ClientsLost, FedMosaicError, RunError
from ..files import atomic_write, is_temp
from ..setup.world import build_federation
from . import trackers
from .checkpoints import (
    config_changes,
    flat,
    latest_checkpoint,
    restore,
    save_checkpoint,
)
from .dirs import (
    check_out,
    claim,
    deployed,
    discard,
    first_missing,
    holding,
    not_a_run,
    note_divergence,
    note_resume,
    read_meta,
    record_amendment,
    recorded_config,
    remove_made,
    run_meta,
    started_threads,
    started_warm,
)
from .records import (
    read_metrics,
    scalars,
    summarize,
    write_csv,
)
from .signals import postfix, progress_bar, stop_between_rounds


def run(cfg: RunConfig, out: str | Path, *, resume: bool = False, amend: bool = False, progress: bool = True,
        stop_after: int | None = None, fd: FederatedData | None = None, pool=None) -> dict:
    """Run (or resume) ``cfg`` in directory ``out``. ``stop_after``: stop once that round is done (as if killed).

    With ``resume`` and ``amend``, ``cfg`` may differ from the saved config in the fields of ``AMENDABLE`` (a smaller
    learning rate after a divergence, more rounds); the change applies from the resumed round on and is recorded
    in ``meta.json`` under ``amendments``. ``pool``: where the clients run (``Federation``'s argument; default
    ``engine.pool``). The directory is held from its claim (a resume: from the start) to the end: another process
    that resumes it meanwhile is refused.
    """
    out = Path(out)
    with holding(out) as hold:
        return _run(cfg, out, resume, amend, progress, stop_after, fd, pool, hold)


def resume_changes(out: Path, cfg: RunConfig, amend: bool) -> dict[str, list]:
    """What resuming the run in ``out`` with ``cfg`` changes (``config_changes``), or one line why it cannot be
    resumed with it; reads only (``--check`` asks the same)."""
    if not (out / "config.yaml").is_file():
        raise FedMosaicError(not_a_run(out))
    others = sorted(p.name for p in out.iterdir() if p.name != "config.yaml" and not is_temp(p))
    if not (out / "meta.json").exists() and others:  # (a run stopped before meta.json holds nothing else)
        raise FedMosaicError(f"--resume: {out} holds a config.yaml but no meta.json, beside "
                             f"{', '.join(others[:4])}{' ...' if len(others) > 4 else ''}: not a run fedmosaic "
                             "started, so nothing there is resumed or overwritten; choose another folder")
    if (out / "meta.json").exists() and read_meta(out) is None and not amend:
        raise FedMosaicError(f"--resume: {out / 'meta.json'} is damaged, so the config the run recorded cannot "
                             "be checked against its config.yaml (an edit would go unnoticed); restore it, or "
                             "resume with --amend to take config.yaml as it is (the damaged file is kept aside)")
    recorded, where = recorded_config(out)
    return config_changes(recorded, cfg, where, amend)


def _run(cfg: RunConfig, out: Path, resume: bool, amend: bool, progress: bool, stop_after: int | None,
         fd: FederatedData | None, pool, hold) -> dict:
    check_out(out, resume)
    if resume and out.is_dir():
        hold()
    changes: dict = {}
    if (out / "checkpoints").exists() and not (out / "checkpoints").is_dir():
        raise FedMosaicError(f"{out / 'checkpoints'} is not a directory; move it aside")
    if resume:
        changes = resume_changes(out, cfg, amend)
    trackers.check(trackers.wanted(cfg))
    # before creating anything: a config or data error leaves no empty run directory
    fed = build_federation(cfg, fd, started_threads(out) if resume else None, pool,
                           started_warm(out) if resume else None)
    print(f"fedmosaic: execution: {fed.execution}", flush=True)  # stdout: stderr is for warnings and errors
    created, claimed = first_missing(out), False
    if resume and deployed(out) and not getattr(fed.pool, "remote", False):  # its clients' state is on its nodes
        raise FedMosaicError(f"--resume: {out} is a deployed run (its clients' state is on their Flower nodes): "
                             "resume it with its deployment's `flwr run ... --run-config 'resume=true'`")
    try:
        out.mkdir(parents=True, exist_ok=True)
        if resume:
            start, records = restore(out, fed)
            if not (out / "meta.json").exists():  # stopped between claiming the directory and writing meta.json
                atomic_write(out / "meta.json", json.dumps(run_meta(cfg, fed), indent=2).encode())
            if cfg.train.rounds < start:
                raise FedMosaicError(f"--amend: train.rounds must be >= the {start} rounds already finished in {out} "
                                     f"(got {cfg.train.rounds})")
            if 0 < start < cfg.train.rounds:
                note_resume(out, start, fed)
            if changes:
                record_amendment(out, cfg, changes, start, fed)
        else:
            start, records = 0, []
            claim(out / "config.yaml", dump(cfg))
            claimed = True
            hold()
            atomic_write(out / "meta.json", json.dumps(run_meta(cfg, fed), indent=2).encode())
    except OSError as e:
        if claimed:  # nothing of value yet: leave no half-made run directory
            (out / "config.yaml").unlink(missing_ok=True)
        remove_made(out, created)
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
                warm = tuple(g.execution.warm for g in fed.groups)
                fed = build_federation(cfg, fed.fd, fed.threads.count, pool, warm)
                start, records = restore(out, fed)
    except BaseException as e:
        done = len(read_metrics(out))
        if not resume and not done:  # stopped before its first round finished: nothing of value, leave nothing
            discard(out, created)
        if isinstance(e, OSError):
            raise RunError(f"cannot write {e.filename or out}: {e.strerror or e}; {out} keeps rounds 0-{done - 1}"
                           if done else f"cannot write {e.filename or out}: {e.strerror or e}") from None
        raise
    finally:
        fed.pool.close()
    return summary


def _rounds(cfg: RunConfig, out: Path, fed: Federation, start: int, records: list[dict], progress: bool,
            stop_after: int | None) -> dict:
    rounds = cfg.train.rounds
    bar = progress_bar(range(start, rounds), cfg.name, progress, start, rounds)
    track = trackers.Trackers(cfg, out, start, flat(cfg.model_dump(mode="json"))) if trackers.wanted(cfg) else None
    summary = None
    try:
        with open(out / "metrics.jsonl", "a") as metrics, stop_between_rounds() as stop:
            for t in bar:
                if _over_budget(cfg, fed, t):
                    last = latest_checkpoint(out)
                    if t > 0 and (last is None or int(last.stem[6:]) != t - 1):
                        save_checkpoint(out, fed, t - 1)
                        write_csv(out / "metrics.csv", records)
                    break
                untrained = None
                if t == 0 and cfg.eval.start:  # the model(s) before any training: the FedProx framework's round 0
                    t1 = time.perf_counter()
                    untrained = fed.evaluate(0), time.perf_counter() - t1
                t0 = time.perf_counter()
                try:
                    rec = fed.round(t)
                except NonFiniteLoss as e:
                    last = latest_checkpoint(out)
                    if last is None or int(last.stem.split("_")[1]) != t - 1:
                        last = save_checkpoint(out, fed, t - 1) if t > 0 else None
                    lr = cfg.train.optimizer.lr_at(t)
                    where = f"after round {t - 1}, whose state is saved" if last else "in the first round"
                    smaller = float(f"{cfg.train.optimizer.lr / 10:.3g}")
                    note_divergence(out, t)
                    raise RunError(f"{e} (learning rate {lr:g}); stopped {where}",
                                   amend=f"train.optimizer.lr={yaml_scalar(smaller)}", diverged=t) from None
                rec["time_round_s"] = time.perf_counter() - t0
                evaluated = (t + 1) % cfg.eval.every == 0 or t == rounds - 1 or fed.task_ends(t)
                if evaluated or (cfg.eval.report_every and (t + 1) % cfg.eval.report_every == 0):
                    t1 = time.perf_counter()  # (a report alone is a message round in a deployment too)
                    rec.update(fed.evaluate(t) if evaluated else fed.report(t))
                    rec["time_eval_s"] = time.perf_counter() - t1
                if untrained is not None:
                    rec["start"] = untrained[0]
                    rec["time_eval_s"] = rec.get("time_eval_s", 0.0) + untrained[1]
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
                records.append(rec)
                if track is not None:  # step = rounds done
                    track.log(scalars(rec, "/"), t + 1)
                if (t + 1) % cfg.checkpoint_every == 0 or t == rounds - 1 or stop.asked:
                    save_checkpoint(out, fed, t)
                    write_csv(out / "metrics.csv", records)
                stop.now()  # a stop asked during the round: it is saved, stop here
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(postfix(rec), refresh=False)
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
    eps = accounting.epsilon(fed.settings, fed.srv.populations(t + 1))
    if eps <= p.max_epsilon:
        return False
    warnings.warn(f"privacy: round {t} would bring epsilon to {eps:.4g} > max_epsilon {p.max_epsilon:g} (delta "
                  f"{p.delta:g}); the run ends after round {t - 1}" if t else
                  f"privacy: the first round alone would spend epsilon {eps:.4g} > max_epsilon {p.max_epsilon:g}; "
                  "no round ran", stacklevel=2)
    return True


