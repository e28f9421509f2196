"""Several algorithms on the same partition, cohorts and batch order; one table and one PNG of learning curves."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np

from ..config import RunConfig, dir_name, dump, load_config
from ..data.federated import build
from ..errors import ConfigError, FedMosaicError, RunError, one_line
from ..files import atomic_write, remove_temp_files
from ..runs.checkpoints import config_changes, config_hash
from ..runs.dirs import (
    check_out,
    claim,
    diverged_round,
    ended,
    first_missing,
    holding,
    not_a_run,
    remove_made,
    unclaimed,
    variant_dir,
)
from ..runs.records import read_metrics, rounds_recorded, summarize
from ..runs.runner import run
from ..setup.groups import data_spec
from ..setup.world import build_federation
from .plots import (
    accuracy_matrix,
    accuracy_per_task,
    cross_heatmap,
    diagnostics,
    diverged,
    learning_curves,
    method_colors,
)

COLUMNS = (
    ("algorithm", "name", "{}"),
    ("rounds", "rounds", "{}"),
    ("global acc", "global_acc_final", "{:.2%}"),
    ("mean over rounds", "global_acc_mean", "{:.2%}"),
    ("mean from the start", "global_acc_mean_from_start", "{:.2%}"),
    ("best-by-val", "global_acc_best_by_val", "{:.2%}"),
    ("F (classes, FedNTD)", "forgetting", "{:+.3f}"),
    ("global on clients (weighted)", "global_clients_acc_final", "{:.2%}"),
    ("its mean over rounds", "global_clients_acc_mean", "{:.2%}"),
    ("its mean from the start", "global_clients_acc_mean_from_start", "{:.2%}"),
    ("its best-by-val", "global_clients_acc_best_by_val", "{:.2%}"),
    ("personal (weighted)", "personal_acc_final", "{:.2%}"),
    ("its mean over rounds", "personal_acc_mean", "{:.2%}"),
    ("its mean from the start", "personal_acc_mean_from_start", "{:.2%}"),
    ("its best-by-val", "personal_acc_best_by_val", "{:.2%}"),
    ("personal (unweighted)", "personal_acc_unweighted_final", "{:.2%}"),
    ("std", "personal_acc_std_final", "{:.2%}"),
    ("worst 10%", "personal_acc_worst10_final", "{:.2%}"),
    ("best 10%", "personal_acc_best10_final", "{:.2%}"),
    ("personal non-zeros", "personal_nonzero_final", "{:,.0f}"),
    ("personal sparsity", "personal_sparsity_final", "{:.2%}"),
    ("intra (last 3)", "intra_last3", "{:.2%}"),
    ("inter (last 3)", "inter_last3", "{:.2%}"),
    ("diverged in round", "diverged_round", "{:.0f}"),
    ("seeds diverged", "diverged_seeds", "{:.0f}"),
    ("CIL avg", "continual_avg", "{:.2%}"),
    ("CIL last task", "continual_final", "{:.2%}"),
    ("BWT", "continual_bwt", "{:+.3f}"),
    ("forgetting (tasks)", "continual_forgetting", "{:+.3f}"),
    ("DP epsilon", "epsilon", "{:.3g}"),
    ("bytes/round", "bytes_per_round", "{:,.0f}"),
    ("wall s", "wall_time_s", "{:.1f}"),
)


def run_all(cfg: RunConfig, out: str | Path, *, resume: bool = False, amend: bool = False, progress: bool = True,
            only: set[str] | None = None) -> list[dict]:
    """Run ``cfg`` (each of its ``compare`` variants in a sub-directory, each of its ``seeds`` in ``seed_<s>``);
    write the table (JSON, Markdown, LaTeX) and the plots. Returns one summary per method (over the seeds: mean
    and std, ``over_seeds``). ``only``: the directory names of the variants to run, the others left as they are
    (one machine a method); the table and plots are then written once every variant has ended, and the summaries
    returned are those of the variants run."""
    out = Path(out)
    with holding(out) as hold:  # a comparison's directory is held as a run's is (each of its runs: its own)
        return _run_all(cfg, out, resume, amend, progress, hold, only)


def _run_all(cfg: RunConfig, out: Path, resume: bool, amend: bool, progress: bool, hold,
             only: set[str] | None = None) -> list[dict]:
    if cfg.seeds:
        return _run_seeds(cfg, out, resume=resume, amend=amend, progress=progress, hold=hold, only=only)
    variants = cfg.variants()
    colors = method_colors([v.name for v in variants])
    if len(variants) == 1:  # one algorithm: the variant, which is cfg itself or the one `compare:` names
        if only is not None and dir_name(variants[0].name) not in only:
            return []
        summaries = [run(variants[0], out, resume=resume, amend=amend, progress=progress)]
        curves = {variants[0].name: read_metrics(out)}
    else:
        fd, created = _claim_comparison(cfg, out, "comparison.yaml", resume, amend, hold)
        summaries, curves = [], {}
        try:
            for v in variants:
                sub = out / dir_name(v.name)
                if only is not None and dir_name(v.name) not in only:
                    continue
                try:
                    summaries.append(run(v, sub, resume=resume and _variant_started(sub, v), amend=amend,
                                         progress=progress, fd=fd))
                except RunError as e:
                    if e.diverged is None:
                        raise
                    # one method's divergence is a result of the comparison, not the end of it
                    warnings.warn(f"{v.name}: {e}; the comparison goes on, its table shows the rounds before",
                                  stacklevel=2)
                    done = read_metrics(sub) if (sub / "metrics.jsonl").is_file() else []
                    summaries.append({**summarize(done, v), "diverged_round": e.diverged})
                curves[v.name] = read_metrics(sub)
        except BaseException:  # (Ctrl-C too: stopped before any run kept a round, it leaves nothing)
            _unclaim(out, "comparison.yaml", resume, created)
            raise
    for (name, recs), s in zip(curves.items(), summaries, strict=True):  # per run, beside its metrics:
        where = out if len(variants) == 1 else out / dir_name(name)
        last = next((r for r in reversed(recs) if "cross" in r), None)
        if last is not None:  # the last cross-client matrix, titled with the rounds it had had
            cross_heatmap(last["cross"]["matrix"], where / "cross_matrix.png",
                          title=f"{name}: round {last['round'] + 1}", names=last["cross"].get("names"))
        if "continual_matrix" in s:  # the continual accuracy matrix
            accuracy_matrix(s["continual_matrix"], where / "accuracy_matrix.png", title=name)
    if only is None:
        write_outputs(out, summaries, curves, f"{cfg.name}: {cfg.data.dataset}", colors)
    elif all(ended(variant_dir(out, v, variants)) for v in variants):  # the last of the methods run one by one
        _write_from_runs(out, f"{cfg.name}: {cfg.data.dataset}", colors)
    return summaries


def _write_from_runs(out: Path, title: str, colors: dict) -> list[dict]:
    """The table and plots of the runs under ``out`` (a seeds or comparison directory), as they are."""
    summaries, curves, notes = from_runs([out])
    for n in notes:
        warnings.warn(n, stacklevel=3)
    write_outputs(out, summaries, curves, title, colors)
    return summaries


def _run_seeds(cfg: RunConfig, out: Path, *, resume: bool, amend: bool, progress: bool, hold,
               only: set[str] | None = None) -> list[dict]:
    """Every seed its own run or comparison in ``out/seed_<s>`` (its own partition unless data.seed is set), then
    the table over the seeds and banded curves in ``out`` (with ``only``: once every seed's every variant ended)."""
    _, created = _claim_comparison(cfg, out, "seeds.yaml", resume, amend, hold, partition=False)
    variants = cfg.variants()
    try:
        ran = []
        for seed in cfg.seeds:
            sub, one = out / f"seed_{seed}", cfg.with_seed(seed)
            started = _variant_started(sub, one, "config.yaml" if len(one.variants()) == 1 else "comparison.yaml")
            ran += run_all(one, sub, resume=resume and started, amend=amend, progress=progress, only=only)
    except BaseException:
        _unclaim(out, "seeds.yaml", resume, created)
        raise
    title = f"{cfg.name}: {cfg.data.dataset}, seeds {', '.join(map(str, cfg.seeds))}"
    colors = method_colors([v.name for v in variants])
    if only is None or all(ended(variant_dir(out / f"seed_{s}", v, variants)) for s in cfg.seeds for v in variants):
        return _write_from_runs(out, title, colors)
    return ran


def comparison_changes(out: Path, saved: str, cfg: RunConfig, amend: bool) -> dict[str, list]:
    """What resuming the comparison or seeds directory ``out`` (its config in ``saved``) with ``cfg`` changes
    (``config_changes``), or one line why it cannot; seeds taken out that have runs there are said (their runs stay,
    the table leaves them out)."""
    changes = config_changes(load_config(out / saved), cfg, out / saved, amend)
    kept = [s for s in (changes.get("seeds") or [None])[0] or []
            if s not in (cfg.seeds or []) and (out / f"seed_{s}").is_dir()]
    if kept:
        warnings.warn(f"--amend: seeds {cfg.seeds} takes out seed{'s' if len(kept) > 1 else ''} "
                      f"{', '.join(map(str, kept))}: {'their' if len(kept) > 1 else 'its'} runs stay in {out}, the "
                      "table leaves them out (list them again to bring them back)", stacklevel=2)
    return changes


def _claim_comparison(cfg: RunConfig, out: Path, saved: str, resume: bool, amend: bool, hold,
                      partition: bool = True):
    """Claim (or, resuming, check and amend) a directory that holds several runs under the config file ``saved``,
    and hold it (``hold``, from ``holding``); the shared partition (``partition``), on which every later variant
    is built once before the first runs, so that what only the partition tells (a variant's memory budget, batch
    plan) is refused before anything runs; and the outermost folder made for ``out`` (None: it was there)."""
    check_out(out, resume)
    changes = {}
    if resume:  # the runs check their own configs; this checks (and records) the whole
        if not (out / saved).is_file():  # (e.g. --seeds on a single run's resume)
            raise FedMosaicError(not_a_run(out, saved))
        if out.is_dir():
            hold()
        changes = comparison_changes(out, saved, cfg, amend)
        if "train.rounds" in changes:  # before the saved config changes: each run refuses fewer rounds than it has
            done = max(((rounds_recorded(m.parent), m.parent) for m in out.glob("**/metrics.jsonl")),
                       default=(0, out), key=lambda x: x[0])
            if cfg.train.rounds < done[0]:
                raise FedMosaicError(f"--amend: train.rounds must be >= the {done[0]} rounds already finished in "
                                     f"{done[1]} (got {cfg.train.rounds})")
        remove_temp_files(out)  # a table or plot whose writing was killed
    fd = build(data_spec(cfg)) if partition else None
    if partition and not resume:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # each variant warns when it runs
            for v in cfg.variants()[1:]:  # (a Ray pool's actors check their shards when the variant runs)
                build_federation(v, fd, pool="none" if v.engine.pool == "ray" else None)
    created = first_missing(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not resume:
            claim(out / saved, dump(cfg))
            hold()
        elif changes:
            atomic_write(out / saved, dump(cfg).encode())
    except OSError as e:
        raise FedMosaicError(f"cannot write the run directory {out}: {e.strerror or e}") from None
    return fd, created


def _unclaim(out: Path, saved: str, resume: bool, created: Path | None) -> None:
    """Stopped (a config error, a signal) before any run kept a round: leave no half-made directory behind
    (nor the folders above it that were made for it, ``created``)."""
    if not resume and out.is_dir() and [p.name for p in out.iterdir()] == [saved]:
        (out / saved).unlink()
        remove_made(out, created)


def write_outputs(out: Path, summaries: list[dict], curves: dict, title: str, colors: dict | None = None) -> None:
    """The table as JSON, Markdown and LaTeX, the learning curves, (class-incremental) accuracy per task and the
    objective's parts and the algorithm's measures per round (``diagnostics.png``, when there are any)."""
    atomic_write(out / "comparison.json", json.dumps(summaries, indent=2).encode())
    for fmt, suffix in (("markdown", "md"), ("latex", "tex")):
        atomic_write(out / f"table.{suffix}", (table(summaries, fmt) + "\n").encode())
    stopped = diverged(summaries)
    learning_curves(curves, out / "learning_curves.png", title=title, colors=colors, stopped=stopped)
    accuracy_per_task(summaries, out / "accuracy_per_task.png", title=title, colors=colors)
    diagnostics(curves, out / "diagnostics.png", title=title, colors=colors, stopped=stopped)


def _variant_started(sub: Path, v: RunConfig, saved: str = "config.yaml") -> bool:
    """Whether a comparison's variant (or a seed's run or comparison) directory holds something to resume. One
    whose ``saved`` config was lost but that holds rounds gets it back from the comparison's (its checkpoints must
    still match it to be used); one that holds nothing, or only what a start killed while claiming it left, starts
    afresh."""
    if (sub / saved).is_file():
        return True
    if not sub.is_dir() or unclaimed(sub) or not any(sub.iterdir()):
        return False
    if saved == "config.yaml" and not (sub / "meta.json").is_file():  # (the run would refuse it: write nothing)
        raise FedMosaicError(f"{sub} holds neither config.yaml nor meta.json beside "
                             f"{', '.join(sorted(p.name for p in sub.iterdir())[:3])}: not a run fedmosaic "
                             "started, so nothing there is resumed or overwritten; move it aside")
    warnings.warn(f"{sub}: {saved} is missing; restored from the comparison's config", stacklevel=3)
    claim(sub / saved, dump(v))
    return True


def diverged_first(d: Path) -> dict[str, int]:
    """The variants that the finished comparison in ``d`` (its ``comparison.json``) records as diverged before
    their first round ended: a new run that finishes no round leaves no directory, so only the table says so."""
    try:
        table = json.loads((d / "comparison.json").read_text())
    except (OSError, ValueError):
        return {}
    return {r["name"]: r["diverged_round"] for r in table if isinstance(r, dict) and isinstance(r.get("name"), str)
            and r.get("diverged_round") == 0} if isinstance(table, list) else {}


def _variant_dirs(d: Path, notes: list[str]) -> list[Path]:
    """A comparison directory stands for its variants, in the comparison's order; a variant that has not started
    (or lost its config), or diverged in its first round, is named in ``notes``."""
    if not (d / "comparison.yaml").is_file() or (d / "config.yaml").is_file():
        return [d]
    found = sorted(p.parent for p in d.glob("*/config.yaml"))
    try:
        variants = load_config(d / "comparison.yaml").variants()
    except FedMosaicError as e:  # the runs are whole: the table goes on with them, in their folders' order
        notes.append(f"{one_line(e)}; the table shows the runs found in {d}, in their folders' order")
        return found
    expected = [d / dir_name(v.name) for v in variants]
    first = diverged_first(d)
    broke = [dir_name(v.name) for v in variants if v.name in first and d / dir_name(v.name) not in found]
    missing = [p.name for p in expected if p not in found and p.name not in broke]
    if missing:
        notes.append(f"{d}: {len(missing)} of its {len(expected)} variants have no run yet, left out of the table: "
                     + ", ".join(missing))
    if broke:
        notes.append(f"{d}: {', '.join(broke)} diverged in round 0 (no run kept), left out of the table")
    return [p for p in expected if p in found] + [p for p in found if p not in expected]


def _run_dirs(d: Path, notes: list[str]) -> list[Path]:
    """The run directories ``d`` stands for: a seeds directory the runs (or comparisons' variants) of the seeds its
    ``seeds.yaml`` lists, in that order; a listed seed not started yet, and a ``seed_*`` folder it does not list
    (a seed removed with --amend, a stray copy), are named in ``notes`` and left out."""
    if not (d / "seeds.yaml").is_file():
        return _variant_dirs(d, notes)
    seeds = load_config(d / "seeds.yaml").seeds or []
    subs = [d / f"seed_{s}" for s in seeds]
    started = [p for p in subs if any((p / f).is_file() for f in ("config.yaml", "comparison.yaml"))]
    if len(started) < len(subs):
        notes.append(f"{d}: seeds {', '.join(p.name[5:] for p in subs if p not in started)} of {len(subs)} have "
                     "no run yet, left out of the table")
    other = sorted(p.name for p in d.glob("seed_*") if p not in subs)
    if other:
        notes.append(f"{d}: {', '.join(other)} not among the seeds of its seeds.yaml, left out of the table")
    return [v for sub in started for v in _variant_dirs(sub, notes)]


def seed_group(cfg: RunConfig) -> str:
    """What runs of one method share whatever their seed: the resolved config without the seeds and what does not
    change the numbers (where it runs, how often it is saved, how many rounds: a seed may stop early). Unlike
    ``run_hash`` it keeps the learning rate, its decay and the evaluation, which a resume may amend: runs that
    differ there are not seeds of one method."""
    return config_hash(cfg, ("seed", "seeds", "data.seed", "name", "engine", "checkpoint_every", "deploy",
                             "train.rounds"))


def from_runs(dirs: list[Path], upto: int | None = None
              ) -> tuple[list[dict], dict[str, list[dict] | list[list[dict]]], list[str]]:
    """Summaries and curves of existing run directories (finished or interrupted), compared at one round: their
    first ``upto`` rounds when given, else the last round every run that has not diverged reached (a diverged run
    keeps its rounds before, marked). Runs whose configs differ only in the seed are one method: its summary is the
    mean ± std over them (``over_seeds``) and its curves a list, one per seed. Also returns warnings: runs cut to
    the common round, runs of one seed on different partitions, or shorter than ``upto``, are not a like-for-like
    comparison."""
    notes: list[str] = []
    found = []  # (directory, config, records)
    for d in (v for d in dirs for v in _run_dirs(d, notes)):
        if not (d / "config.yaml").is_file():
            raise FedMosaicError(f"{d} is not a run directory (no config.yaml)")
        records = read_metrics(d)
        if not records:
            raise FedMosaicError(f"{d} has no finished round yet (metrics.jsonl is empty)")
        try:
            cfg = load_config(d / "config.yaml")
        except ConfigError as e:  # (which of the runs it is)
            raise ConfigError(f"{d / 'config.yaml'}: {e}") from None
        found.append((d, cfg, records))
    lengths = {len(r) for d, _, r in found if diverged_round(d) is None}
    if upto is None and len(lengths) > 1:
        upto = min(lengths)
        notes.append(f"the runs stopped at different rounds ({', '.join(map(str, sorted(lengths)))}): compared at "
                     f"round {upto}, the last all of them reached (--rounds N to choose another)")
    elif upto is not None:
        notes += [f"{d} has only {len(r)} rounds (< {upto})" for d, _, r in found if len(r) < upto]
    groups: dict[str, list[tuple[int, dict, list[dict]]]] = {}  # per method: (seed, summary, records)
    names: dict[str, str] = {}  # per method its name in the table
    partitions: dict[int, dict[str, str | None]] = {}  # per seed: per method its partition's hash
    cohorts: dict[int, dict[str, list]] = {}  # per seed: per method who trained each round (None: not recorded)
    for d, cfg, records in found:
        records = records[:upto]
        key = cfg.name + "\0" + seed_group(cfg)
        if any(seed == cfg.seed for seed, _, _ in groups.get(key, ())):
            key += "\0" + str(d)  # the same run twice is not a second seed
        if key not in names:
            names[key] = cfg.name if cfg.name not in names.values() else str(d)
        summary = {**summarize(records, cfg), "name": names[key]}
        if diverged_round(d) is not None:
            summary["diverged_round"] = diverged_round(d)
        groups.setdefault(key, []).append((cfg.seed, summary, records))
        try:
            meta = json.loads((d / "meta.json").read_text())
            data_hash = meta["data_hash"][:10] + (f" (tasks {meta['tasks_hash'][:8]})" if "tasks_hash" in meta else "")
        except (OSError, ValueError, AttributeError, TypeError, KeyError):
            data_hash = None
            notes.append(f"{d}/meta.json is missing or damaged: cannot tell which partition the run used")
        partitions.setdefault(cfg.seed, {})[names[key]] = data_hash
        cohorts.setdefault(cfg.seed, {})[names[key]] = [r.get("cohort") for r in records]
    for seed, hashes in partitions.items():
        if len(set(hashes.values())) > 1:
            notes.append(f"the runs of seed {seed} use different partitions (data hashes differ): " +
                         ", ".join(f"{n} {h}" for n, h in hashes.items()))
        t = _first_other_cohort(cohorts[seed])
        if t is not None:
            notes.append(f"the runs of seed {seed} trained different clients from round {t} on (their cohorts "
                         "differ: " + ", ".join(f"{n} {c[t]}" for n, c in cohorts[seed].items()
                                                 if len(c) > t and c[t] is not None) + ")")
    summaries, curves = [], {}
    for key, runs in groups.items():
        name = names[key]
        if len(runs) == 1:
            summaries.append(runs[0][1])
            curves[name] = runs[0][2]
        else:
            summaries += over_seeds({name: [s for _, s, _ in runs]})
            curves[name] = [r for _, _, r in runs]
    return summaries, curves, notes


def _first_other_cohort(runs: dict[str, list]) -> int | None:
    """The first round in which two of ``runs`` (per method, its cohort each round, None where a run recorded
    none) trained different clients, or None."""
    for t in range(max(map(len, runs.values()), default=0)):
        if len({tuple(c[t]) for c in runs.values() if len(c) > t and isinstance(c[t], list)}) > 1:
            return t
    return None


def over_seeds(groups: dict[str, list[dict]]) -> list[dict]:
    """One summary per method from the summaries of its seeds: every number of the table as the mean over the
    seeds, with its sample standard deviation (n − 1) under ``<key>_std``; ``seeds``: how many. Lists (the
    accuracy after each task) are averaged element-wise where the seeds agree in length."""
    out = []
    for name, runs in groups.items():
        agg: dict = {"name": name, "algorithm": runs[0].get("algorithm"), "seeds": len(runs)}
        for key in dict.fromkeys(k for s in runs for k in s):
            vals = [s.get(key) for s in runs]
            if key == "diverged_round":  # seeds that diverged: how many (their rounds before are in the means)
                agg["diverged_seeds"] = float(sum(v is not None for v in vals))
            elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
                agg[key] = float(np.mean(vals))
                agg[f"{key}_std"] = float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
            elif key == "continual_seen" and all(isinstance(v, list) and len(v) == len(vals[0]) for v in vals):
                agg[key] = np.mean(vals, axis=0).tolist()
                agg[f"{key}_std"] = (np.std(vals, axis=0, ddof=1) if len(vals) > 1 else np.zeros(len(vals[0]))).tolist()
            elif key == "continual_per_task" and all(isinstance(v, list) or v is None for v in vals):
                vals = [v or [] for v in vals]  # (None: a seed that ended no task yet)
                agg[key], agg[f"{key}_std"], agg[f"{key}_seeds"] = [], [], []
                for i in range(max(map(len, vals))):  # task i over the seeds that reached it (one may diverge)
                    tasks = [v[i] for v in vals if len(v) > i]
                    common = [n for n in tasks[0] if all(n in t for t in tasks)]
                    agg[key].append({n: float(np.mean([t[n] for t in tasks])) for n in common})
                    agg[f"{key}_std"].append({n: float(np.std([t[n] for t in tasks], ddof=1)) if len(tasks) > 1
                                              else 0.0 for n in common})
                    agg[f"{key}_seeds"].append(len(tasks))
            elif key == "terms_last" and all(isinstance(v, dict) for v in vals):
                agg[key] = {n: float(np.mean([v[n] for v in vals if n in v])) for n in vals[0]}
        out.append(agg)
    return out


def _cells(summaries: list[dict], pm: str = " ± ") -> list[list[str]]:
    """Header and rows of the table: the columns some summary has; mean ± std where a summary is over seeds."""
    cols = [(h, k, f) for h, k, f in COLUMNS if any(k in s for s in summaries)]
    if any(s.get("seeds", 1) > 1 for s in summaries):
        cols.insert(1, ("seeds", "seeds", "{}"))

    def cell(s: dict, k: str, f: str) -> str:
        if s.get(k) is None:  # (absent, or None: e.g. the epsilon of a run without noise, which has none)
            return "-"
        if k == "rounds" and float(s[k]).is_integer():
            return str(int(s[k]))
        std = s.get(f"{k}_std")
        return f.format(s[k]) + (f"{pm}{f.format(std)}" if std is not None and s.get("seeds", 1) > 1 else "")

    return [[h for h, _, _ in cols]] + [[cell(s, k, f) for _, k, f in cols] for s in summaries]


def table(summaries: list[dict], fmt: str = "text") -> str:
    """The summary table as aligned text, a Markdown table or a LaTeX tabular (booktabs)."""
    if fmt == "latex":
        rows = _cells(summaries, pm="\0")  # a placeholder, so that escaping leaves the ± alone
        esc = lambda c: re.sub(r"([%&_#${}])", r"\\\1", c).replace("\0", r" $\pm$ ")  # noqa: E731
        body = [" & ".join(map(esc, r)) + r" \\" for r in rows]
        return "\n".join([r"\begin{tabular}{l" + "r" * (len(rows[0]) - 1) + "}", r"\toprule", body[0], r"\midrule",
                          *body[1:], r"\bottomrule", r"\end{tabular}"])
    rows = _cells(summaries)
    if fmt == "markdown":
        lines = ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
        lines.insert(1, "|" + "|".join(":---" if i == 0 else "---:" for i in range(len(rows[0]))) + "|")
        return "\n".join(lines)
    return _aligned(rows)


def terms_table(summaries: list[dict]) -> str:
    """The named parts of each run's local objective in its last round (empty when no run has several)."""
    names = list(dict.fromkeys(n for s in summaries for n in s.get("terms_last", {})))
    if not names:
        return ""
    rows = [["loss terms (last round)", *names]]
    rows += [[s["name"], *(f"{s['terms_last'][n]:.4g}" if n in s.get("terms_last", {}) else "-" for n in names)]
             for s in summaries]
    return _aligned(rows)


def tasks_table(summaries: list[dict]) -> str:
    """Class-incremental runs, per task: the accuracy on the classes seen so far, the algorithm's report at the
    task's end and the loss terms' means over its rounds (mean ± std where over seeds; empty without such runs)."""
    runs = [s for s in summaries if s.get("continual_per_task")]
    if not runs:
        return ""
    T = max(len(s["continual_per_task"]) for s in runs)
    rows = [["per task", "", *(f"task {i + 1}" for i in range(T))]]
    for s in runs:
        tasks, stds = s["continual_per_task"], s.get("continual_per_task_std")
        seeds = s.get("continual_per_task_seeds", [1] * len(tasks))

        def cell(i: int, n: str, f: str) -> str:
            if n not in tasks[i]:
                return "-"
            fewer = f" ({seeds[i]} of {s['seeds']} seeds)" if seeds[i] < s.get("seeds", 1) else ""
            return f.format(tasks[i][n]) + (f" ± {f.format(stds[i][n])}" if seeds[i] > 1 else "") + fewer

        for n in dict.fromkeys(n for t in tasks for n in t):
            f = "{:.2%}" if n == "seen" else "{:.4g}"
            rows.append([s["name"], n, *(cell(i, n, f) for i in range(len(tasks))), *["-"] * (T - len(tasks))])
    return _aligned(rows)


def _aligned(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
