"""``fedmosaic reproduce PAPER``: a seed paper's headline claims, each checked against the comparison that tests it.

A paper's claims live in one versioned data file, ``claims/<paper>.yaml``: the experiments (a preset, the seeds, the
``--set`` overrides of each scale: ``cpu`` reduced, ``paper`` the paper's own setting) and, per claim, where in the
paper it stands, the paper's number and how ours is compared with it:

- ``value``: the method's metric against the paper's number (within ``tolerance`` points, or outside it);
- ``gain``: the method's metric minus the baseline's, per seed (paired: same partition, cohorts and batches),
  against the paper's gain (within tolerance / the same direction / contradicted);
- ``best``: the method above every other of ``methods`` (holds / contradicted);
- ``order``: ``methods`` in this order (holds / contradicted, naming the first pair that is not).

Each experiment runs as ``fedmosaic run PRESET --seeds ... --set ...`` would, in ``<out>/<experiment>``, or
resumes there; a claim whose experiment cannot run (a dataset missing, a GPU-only setting without a GPU, a run
that failed) is reported as not run with the reason, never dropped. ``reproduction.md`` and ``reproduction.json``
in ``<out>`` hold the verdicts; running the same command again resumes what is unfinished and rewrites them.
"""

from __future__ import annotations

import json
import math
import platform
import shlex
import time
import warnings
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import Field, ValidationError, model_validator

from ..config import dir_name, dump, load_config, validate
from ..errors import ConfigError, FedMosaicError, RunError, Stopped, one_line
from ..files import atomic_write
from ..runs.dirs import check_out, claim, ended, hardware, holding, variant_dir
from ..runs.records import rounds_recorded
from ..schema import Schema

CLAIMS = Path(__file__).with_name("claims")
REQUEST = "reproduction.yaml"
Scale = Literal["cpu", "paper"]


class ExperimentSpec(Schema):
    """One comparison that several claims read: a preset run over seeds, with each scale's overrides."""

    preset: str = Field(description="the preset (or a config path relative to the claims file)")
    seeds: list[int] = Field([0, 1, 2], min_length=1)
    cpu: list[str] = Field([], description="--set overrides of the reduced setting")
    paper: list[str] = Field([], description="--set overrides of the paper's setting (usually none)")
    gpu: list[Scale] = Field([], description="the scales that need a GPU (not run on a CPU-only machine)")
    cost: dict[Scale, str] = Field({}, description="what each scale costs, in words (e.g. '~40 min, 2-core CPU')")


class ClaimSpec(Schema):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    text: str = Field(description="the claim as the paper makes it")
    source: str = Field(description="where in the paper: the table, figure or section")
    experiment: str
    kind: Literal["value", "gain", "best", "order"]
    metric: list[str] = Field(min_length=1, description="summary keys, the first a method has is used")
    percent: bool = Field(True, description="the metric is a fraction shown in percent points (else as it is)")
    lower: bool = Field(False, description="lower is better (e.g. forgetting)")
    method: str | None = None
    baseline: str | None = None
    methods: list[str] = Field([], description="best: the others; order: best first")
    paper: float | None = Field(None, description="the paper's number (value, gain), in the metric's unit")
    tolerance: float = Field(2.0, ge=0, description="within this many units of the paper's number")

    @model_validator(mode="after")
    def _fields(self):
        need = {"value": ("method", "paper"), "gain": ("method", "baseline"), "best": ("method",), "order": ()}
        missing = [f for f in need[self.kind] if getattr(self, f) is None]
        if missing or (self.kind in ("best", "order") and not self.methods):
            raise ValueError(f"claim {self.id}: a {self.kind} claim needs {', '.join(missing) or 'methods'}")
        return self


class PaperSpec(Schema):
    paper: str
    title: str
    text: str = Field(description="the paper's text, as shipped beside the project")
    experiments: dict[str, ExperimentSpec]
    claims: list[ClaimSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _refs(self):
        ids = [c.id for c in self.claims]
        if len(set(ids)) != len(ids):
            raise ValueError("claim ids must be unique")
        for c in self.claims:
            if c.experiment not in self.experiments:
                raise ValueError(f"claim {c.id}: no experiment {c.experiment!r}")
        return self


def papers() -> list[str]:
    return sorted(p.stem for p in CLAIMS.glob("*.yaml"))


def load_paper(name: str) -> PaperSpec:
    path = CLAIMS / f"{name}.yaml"
    if not path.is_file():
        raise FedMosaicError(f"reproduce: no claims for paper {name!r}; papers: {', '.join(papers())}")
    try:
        return PaperSpec.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as e:  # a broken data file is fedmosaic's bug, said in one line
        raise ConfigError(f"{path.name}: {e.errors()[0]['msg']}") from None


def experiment_config(spec: ExperimentSpec, scale: str, sets: list[str], seeds: list[int] | None):
    from ..presets import preset_names, preset_path

    source = preset_path(spec.preset) if spec.preset in preset_names() else CLAIMS / spec.preset
    cfg = load_config(source, [*getattr(spec, scale), *sets], {"seeds": list(seeds or spec.seeds)})
    return validate(yaml.safe_load(dump(cfg)), spec.preset)  # as saved: a resume compares it with the saved one


def command(spec: ExperimentSpec, scale: str, sets: list[str], seeds: list[int], out: Path) -> str:
    """The ``fedmosaic run`` command that runs one experiment by itself (``--resume`` once it has started)."""
    if (out / "seeds.yaml").is_file():
        return shlex.join(["fedmosaic", "run", "--resume", str(out)])
    parts = ["fedmosaic", "run", spec.preset, "--seeds", *map(str, seeds)]
    for s in [*getattr(spec, scale), *sets]:
        parts += ["--set", s]
    return shlex.join([*parts, "--out", str(out)])


def missing_data(cfg) -> str | None:
    """Why the experiment's data is not here (its dataset, or a dataset its public stream draws), or None."""
    from ..data.registry import dataset_names, find_layout, get_spec, missing_message

    names = [cfg.data.dataset]
    if cfg.data.public is not None and cfg.data.public.source in dataset_names():
        names.append(cfg.data.public.source)
    for n in names:
        spec = get_spec(n)
        if find_layout(spec) is None:
            return missing_message(spec)
    return None


def all_ended(where: Path, cfg) -> bool:
    """Every seed's every method of the experiment in ``where`` ended, with this very config (a seed's folder lost
    since is run again). Finished, nothing to resume, once its table is written too (``comparison.json``); without
    it (a copy of the runs alone) the command writes it, training nothing."""
    from .compare import diverged_first

    saved, variants = where / "seeds.yaml", cfg.variants()
    return (saved.is_file() and load_config(saved) == cfg
            and all(ended(variant_dir(where / f"seed_{s}", v, variants)) or v.name in diverged_first(where / f"seed_{s}")
                    for s in cfg.seeds for v in variants))


def check_same_setting(paper: str, out: Path, where: Path, cfg) -> None:
    """An experiment already started under ``where`` resumes only with the config it started with. The request
    is the saved one by now (``saved_request``), so a difference means the preset or fedmosaic's defaults changed
    since: refused in one line before anything runs or is written (the resume itself would refuse it later, and
    the claims would be reported as not run over the report of the runs that exist)."""
    from ..runs.checkpoints import config_diff, shown_diff

    saved = next((where / f for f in ("seeds.yaml", "comparison.yaml", "config.yaml") if (where / f).is_file()), None)
    if saved is None:
        return
    try:
        started = load_config(saved)
    except FedMosaicError as e:
        raise FedMosaicError(f"reproduce {paper}: {saved} is damaged ({e}); restore it, or choose another --out") \
            from None
    changed = config_diff(started, cfg)
    if changed:
        raise FedMosaicError(f"reproduce {paper}: {where} was started with another config than this fedmosaic "
                             f"builds from {out / REQUEST} ({shown_diff(changed)}); resume it with the version "
                             "that started it, or choose another --out")


def progress_of(where: Path, cfg) -> str | None:
    """How far the experiment in ``where`` has got: per seed, its finished methods and the rounds of the one
    under way (what ``--status`` reports while the run goes on elsewhere); None where it has not started."""
    if not where.is_dir():
        return None
    variants, rounds, parts = cfg.variants(), cfg.train.rounds, []
    for s in cfg.seeds or [cfg.seed]:
        base = where / f"seed_{s}" if cfg.seeds else where
        done, going = 0, []
        for v in variants:
            sub = variant_dir(base, v, variants)
            if ended(sub):
                done += 1
            elif (sub / "metrics.jsonl").is_file():
                going.append(f"{v.name} {rounds_recorded(sub)} of {rounds} rounds")
        parts.append(f"seed {s}: {done} of {len(variants)} methods finished" + "".join(f", {g}" for g in going))
    return "; ".join(parts)


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# ---- verdicts -----------------------------------------------------------------------------------------------------
def per_seed(out: Path, cfg) -> list[list[dict]]:
    """Per seed of the experiment ``cfg`` under ``out`` (``seed_<s>/``, or ``out``), the summaries of its methods
    that have ended so far (empty where none has): each claim is judged on the seeds where all of its methods
    have, so a comparison under way already answers the claims its finished runs decide."""
    dirs = [out / f"seed_{s}" for s in cfg.seeds] if cfg.seeds else [out]
    return [seed_summaries(d, cfg.variants()) for d in dirs]


def seed_summaries(where: Path, variants: list) -> list[dict]:
    """One seed's summaries, from its runs (the one source: a seed's ``comparison.json`` may be lost, stale or not
    committed): those of its ``variants`` that have ended — finished, or diverged (its rounds before are its
    result, marked ``diverged_round``; one that diverged in its first round has only that mark)."""
    from ..runs.dirs import diverged_round
    from ..runs.records import read_metrics
    from .compare import diverged_first, from_runs

    subs, summaries, first = [], [], diverged_first(where)
    for v in variants:
        d = variant_dir(where, v, variants)
        if ended(d) and read_metrics(d):
            subs.append(d)
        elif ended(d) or v.name in first:  # (a new run that diverged in round 0 leaves no directory)
            summaries.append({"name": v.name, "algorithm": v.algorithm.name,
                              "diverged_round": diverged_round(d) if ended(d) else first[v.name]})
    if subs:
        found, _, notes = from_runs(subs)
        for n in notes:  # (a missing meta.json, runs of one seed on different partitions)
            warnings.warn(n, stacklevel=2)
        summaries = found + summaries
    return summaries


def find(summaries: list[dict], method: str) -> dict | None:
    """A method's summary: the variant of that name, or the only one of that algorithm."""
    exact = [s for s in summaries if s.get("name") == method]
    algo = [s for s in summaries if s.get("algorithm") == method]
    return (exact or (algo if len(algo) == 1 else [None]))[0]


def metric(summary: dict | None, claim: ClaimSpec) -> float | None:
    if summary is None:
        return None
    value = next((summary[k] for k in claim.metric if isinstance(summary.get(k), (int, float))), None)
    if value is None or not math.isfinite(value):
        return None
    return 100 * value if claim.percent else value


def mean_std(values: list[float]) -> tuple[float, float | None]:
    return float(np.mean(values)), (float(np.std(values, ddof=1)) if len(values) > 1 else None)


def judge(claim: ClaimSpec, seeds: list[list[dict]]) -> dict:
    """The claim's verdict on the seeds' summaries (one list per seed of the experiment): ours (mean, std over the
    seeds where every method the claim names has a result, paired per seed), the difference to the paper's
    number, the verdict, a note, and on how many of those seeds the claim holds by itself (a mean can hold where
    most seeds do not). A seed left out because a method diverged in its first round or has no finite value is
    named (``left_out``); one whose methods have not all finished only counts as not judged yet."""
    names = [m for m in [claim.method, claim.baseline, *claim.methods] if m]
    found = [{m: find(s, m) for m in names} for s in seeds]
    values_of = [{m: metric(f, claim) for m, f in row.items()} for row in found]
    used = [s for s, h in zip(seeds, values_of, strict=True) if None not in h.values()]
    have = [h for h in values_of if None not in h.values()]
    # a method that ended in a seed without a value: diverged in its first round, or its metric is missing / NaN
    lost_in = Counter((m, "diverged in its first round" if f.get("diverged_round") is not None
                       else f"has no finite {' / '.join(claim.metric)}")
                      for row, h in zip(found, values_of, strict=True) for m, f in row.items()
                      if f is not None and h[m] is None)
    lost = "; ".join(f"{m} {what} in {k} of {len(seeds)} seeds" for (m, what), k in lost_in.items())
    if not have:
        unfinished = [m for m in names if all(row[m] is None for row in found)]
        why = "; ".join(x for x in (f"{', '.join(unfinished)} not finished in any seed yet" if unfinished else "",
                                    lost) if x)
        return {"verdict": "not run", "why": why or f"{', '.join(names)} have not finished in the same seed yet"}
    of = {"seeds": len(have), "of": len(seeds)}
    if lost:
        of["left_out"] = lost + " (those seeds left out)"
    broke = {m: [find(s, m)["diverged_round"] for s in used if find(s, m).get("diverged_round") is not None]
             for m in names}
    if any(broke.values()):  # its rounds before count as its result, and the claim says so
        of["diverged"] = "; ".join(f"{m} diverged (round {', '.join(map(str, r))}) in {len(r)} of {len(used)} "
                                   "seeds: its rounds before count" for m, r in broke.items() if r)

    def values(method):
        return [h[method] for h in have]

    def per_seed_count(holds: list[bool], what: str) -> dict:
        return {"per_seed": f"{what} on {sum(holds)} of {len(holds)} seeds"} if len(holds) > 1 else {}

    sign = -1 if claim.lower else 1
    if claim.kind in ("value", "gain"):
        ours = values(claim.method)
        if claim.kind == "gain":
            ours = [a - b for a, b in zip(ours, values(claim.baseline), strict=True)]
        mean, std = mean_std(ours)
        out = {"ours": mean, "std": std, **of}
        if claim.kind == "gain":  # the direction claimed: the paper's sign, else better than the baseline
            want = math.copysign(1, claim.paper) if claim.paper else sign
            out |= per_seed_count([want * g > 0 for g in ours], "in the claimed direction")
        if claim.paper is None:
            return {**out, "verdict": "holds" if sign * mean > 0 else "contradicted"}
        diff = mean - claim.paper
        if abs(diff) <= claim.tolerance:
            verdict = "within tolerance"
        elif claim.kind == "value":
            verdict = "outside tolerance"
        else:
            verdict = "same direction" if mean * claim.paper > 0 else "contradicted"
        return {**out, "difference": diff, "verdict": verdict}
    means = {m: mean_std(values(m)) for m in names}
    if claim.kind == "best":
        above = [m for m in claim.methods if sign * means[m][0] >= sign * means[claim.method][0]]
        runner = max(claim.methods, key=lambda m: sign * means[m][0])
        margins = [sign * h[claim.method] - max(sign * h[m] for m in claim.methods) for h in have]
        out = {"ours": means[claim.method][0], "std": means[claim.method][1], **of,
               "difference": means[claim.method][0] - means[runner][0],
               **per_seed_count([x > 0 for x in margins], "the best"),
               "note": f"next: {runner} {means[runner][0]:.2f}"}
        if above:
            return {**out, "verdict": "contradicted", "note": f"not above {', '.join(above)}; {out['note']}"}
        return {**out, "verdict": "holds"}
    order = claim.methods
    flipped = next(((a, b) for a, b in pairwise(order) if sign * means[a][0] <= sign * means[b][0]), None)
    seeds_hold = per_seed_count([all(sign * h[a] > sign * h[b] for a, b in pairwise(order)) for h in have],
                                "the order holds")
    note = " > ".join(f"{m} {means[m][0]:.2f}" for m in order) if not claim.lower else \
        " < ".join(f"{m} {means[m][0]:.2f}" for m in order)
    if flipped:  # (the claimed order with our values: not written with '>', which they contradict)
        return {"verdict": "contradicted", **of, **seeds_hold, "note": f"{flipped[0]} is not above {flipped[1]}; "
                "ours, in the claimed order: " + ", ".join(f"{m} {means[m][0]:.2f}" for m in order)}
    return {"verdict": "holds", **of, **seeds_hold, "note": note}


# ---- the command ----------------------------------------------------------------------------------------------------
def reproduce(paper: str, out: Path, *, scale: str = "cpu", claims: list[str] | None = None, sets: list[str] = (),
              seeds: list[int] | None = None, progress: bool = True, gpu: bool | None = None,
              status: bool = False, methods: list[str] | None = None) -> dict:
    """Run (or resume) what the chosen claims of ``paper`` need under ``out`` and judge them; write
    ``reproduction.md`` and ``reproduction.json`` there and return the latter's content. ``status``: run and write
    nothing — how far each experiment has got, and each claim's verdict on the seeds where its methods have
    ended. ``methods``: run only these methods of each experiment (an algorithm's name, or a variant's as
    ``--list`` shows it); the others are left as they are, to run elsewhere or later. A resume takes the --set
    and --seeds the reproduction started with; one command at a time holds ``out``."""
    from .compare import run_all

    spec = load_paper(paper)
    known = [c.id for c in spec.claims]
    unknown = [c for c in claims or [] if c not in known]
    if unknown:
        raise FedMosaicError(f"reproduce {paper}: no claim {unknown[0]!r}; claims: {', '.join(known)}")
    if any(s.split("=", 1)[0].strip() == "seeds" for s in sets):
        raise FedMosaicError(f"reproduce {paper}: --set seeds=... is not how a reproduction's seeds are chosen: "
                             "use --seeds")
    resume = (out / REQUEST).is_file()
    if status and not resume:
        raise FedMosaicError(f"{out}: no reproduction of {paper} started there (run it first, without --status)")
    if resume:  # it resumes as it started: its --set and --seeds are the saved ones
        defaults = [e.seeds for e in spec.experiments.values()]
        sets, seeds = saved_request(out, paper, scale, list(sets), seeds, defaults)
    else:
        try:
            check_out(out, resume=False)
        except FedMosaicError:
            raise FedMosaicError(f"{out} exists and holds no reproduction (no {REQUEST}); choose another --out") \
                from None
    request = {"paper": paper, "scale": scale, "set": list(sets), "seeds": seeds}
    asked = {c.experiment for c in spec.claims if not claims or c.id in claims}
    # the report covers the claims asked for and every claim whose experiment runs now or is in the folder (asked
    # before): the same claims whether the command ran through or was stopped and resumed
    chosen = [c for c in spec.claims
              if not claims or c.id in claims or c.experiment in asked or (out / c.experiment).is_dir()]
    names = list(dict.fromkeys(c.experiment for c in chosen))
    # every config is built before anything runs or is written: a bad --set is refused in one line first
    configs = {n: experiment_config(spec.experiments[n], scale, list(sets), seeds) for n in names}
    if resume:
        for n in names:
            check_same_setting(paper, out, out / n, configs[n])
    only = picked(paper, {n: configs[n] for n in names if n in asked}, methods)
    gpu = has_gpu() if gpu is None else gpu
    with holding(out) as hold:  # one reproduction at a time in a folder; --status reads beside it
        if not status:
            if not resume:
                out.mkdir(parents=True, exist_ok=True)
                claim(out / REQUEST, yaml.safe_dump(request, sort_keys=False))
            hold()
        runs: dict[str, dict] = {}
        for n in names:
            exp, cfg, where = spec.experiments[n], configs[n], out / n
            run: dict = {"cost": exp.cost.get(scale)}
            why = None
            ended_all = all_ended(where, cfg)  # judged from its runs, also where its data or GPU is not
            if ended_all and (where / "comparison.json").is_file():
                run["finished"] = True
            elif ended_all and (status or n not in asked):  # (the command writes its table, no more)
                run["ended"] = True
            else:
                why = missing_data(cfg) or (f"the {scale} setting needs a GPU and none is here"
                                            if scale in exp.gpu and not gpu else None)
                if status or why or n not in asked:
                    run["progress"] = progress_of(where, cfg)
                if why is None and not status and n in asked:
                    started = time.perf_counter()
                    try:
                        run_all(cfg, where, resume=(where / "seeds.yaml").is_file(), progress=progress,
                                only=None if only is None else only[n])
                    except (RunError, Stopped):  # the machine's problem or the user's signal: all stops
                        raise
                    except FedMosaicError as e:  # refused (e.g. too big for this machine): the rest run
                        why = f"refused: {e}"
                    run["wall_s"] = time.perf_counter() - started
            run = {"command": command(exp, scale, list(sets), cfg.seeds, where), **run}  # (after it: --resume)
            runs[n] = {**run, "not_run": why} if why else run
        verdicts = []
        for c in chosen:
            # a claim is judged on the runs there are; where there are none, the reason its experiment did not run
            v = judge(c, per_seed(out / c.experiment, configs[c.experiment]))
            if v["verdict"] == "not run" and "not_run" in runs[c.experiment]:
                v["why"] = runs[c.experiment]["not_run"]
            verdicts.append({"id": c.id, "source": c.source, "text": c.text, "kind": c.kind, "paper": c.paper,
                             "experiment": c.experiment, **v})
        report = {"paper": paper, "title": spec.title, "scale": scale, "request": request, "machine": machine(),
                  "experiments": runs, "claims": verdicts}
        if not status:
            atomic_write(out / "reproduction.json", json.dumps(report, indent=2).encode())
            atomic_write(out / "reproduction.md", markdown(report).encode())
    return report


def picked(paper: str, configs: dict, methods: list[str] | None) -> dict[str, set[str]] | None:
    """Per experiment, the directory names of its variants that ``methods`` names (an algorithm's name or a
    variant's); a name that is no method of any of them is refused in one line before anything runs."""
    if methods is None:
        return None

    def names(v) -> set[str]:
        return {v.name, dir_name(v.name), v.algorithm.name}

    variants = {n: cfg.variants() for n, cfg in configs.items()}
    known = set().union(*(names(v) for vs in variants.values() for v in vs))
    bad = [m for m in methods if m not in known]
    if bad:
        have = sorted({dir_name(v.name) for vs in variants.values() for v in vs})
        raise FedMosaicError(f"reproduce {paper} --methods: {bad[0]!r} is no method of the claims asked for; "
                             f"methods: {', '.join(have)}")
    return {n: {dir_name(v.name) for v in vs if names(v) & set(methods)} for n, vs in variants.items()}


def saved_request(out: Path, paper: str, scale: str, sets: list[str], seeds: list[int] | None,
                  defaults: list[list[int]]) -> tuple[list[str], list[int] | None]:
    """The --set and --seeds a reproduction in ``out`` started with, which its resume takes; another paper,
    scale, --set or --seeds given is refused in one line (the experiments not started yet would run with
    them, the others not: one report over two settings)."""
    path = out / REQUEST
    try:
        saved = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise FedMosaicError(f"{path} is damaged ({one_line(str(e), 200)}); restore it, or choose another --out") \
            from None
    ok = isinstance(saved, dict) and isinstance(saved.get("set"), list) and \
        all(isinstance(x, str) for x in saved["set"]) and (saved.get("seeds") is None or (
            isinstance(saved["seeds"], list) and all(isinstance(x, int) for x in saved["seeds"])))
    if not ok:
        raise FedMosaicError(f"{path} is damaged (not the paper, scale, set and seeds a reproduction saves); "
                             "restore it, or choose another --out")
    if (saved.get("paper"), saved.get("scale")) != (paper, scale):
        raise FedMosaicError(f"{out} holds the reproduction of {saved.get('paper')} at scale {saved.get('scale')}; "
                             "choose another --out")
    was = saved["seeds"]  # None: each experiment's own seeds (``defaults``)
    if (sets and sets != saved["set"]) or (seeds is not None and (
            list(seeds) != was if was is not None else any(list(seeds) != d for d in defaults))):
        shown = " ".join([*(f"--set {shlex.quote(x)}" for x in saved["set"]),
                          *(["--seeds", *map(str, was)] if was is not None else [])]) or "no --set or --seeds"
        raise FedMosaicError(f"{out} holds the reproduction of {paper} started with {shown}; the same command "
                             "without --set and --seeds resumes it as it started; choose another --out for another "
                             "setting")
    return saved["set"], saved["seeds"]


def machine() -> dict:
    import torch

    return {"host": platform.node(), **hardware("cuda" if torch.cuda.is_available() else "cpu"),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M")}


def _num(v: float | None, std: float | None = None) -> str:
    if v is None:
        return "–"
    return f"{v:.2f}" + (f" ± {std:.2f}" if std is not None else "")


def _state(r: dict) -> str:
    """How far one experiment of the report got, in words."""
    so_far = r.get("progress")
    if "not_run" in r:
        return f"not run: {r['not_run']}" + (f"; so far: {so_far}" if so_far else "")
    if r.get("finished"):
        return "finished before"
    if r.get("ended"):
        return "every method of every seed finished; the command writes its table without training"
    if "progress" in r:
        return "not started" if so_far is None else f"under way: {so_far}"
    return f"{r['wall_s']:.0f} s this time"


def seeds_judged(c: dict) -> str:
    """The seeds a claim was judged on: " (3 seeds)", or " (1 of 3 seeds)" where fewer have its results."""
    if not c.get("seeds"):
        return ""
    k, n = c["seeds"], c.get("of", c["seeds"])
    return f" ({k} of {n} seeds)" if k < n else f" ({n} seed{'s' if n > 1 else ''})"


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# Reproduction: {report['title']}", "",
             f"Scale `{report['scale']}`; {m['date']}; {m['cpu']}, {m['cores']} cores"
             + (f", {m['gpu']}" if m["gpu"] else ", no GPU") + f"; torch {m['torch']}.", "",
             "| claim | where | paper | ours (mean ± std over seeds) | difference | verdict |",
             "|---|---|---|---|---|---|"]
    for c in report["claims"]:
        detail = "; ".join(x for x in (c.get("why") or c.get("note"), c.get("per_seed"), c.get("diverged"),
                                       c.get("left_out")) if x)
        lines.append(f"| {c['id']}: {c['text']} | {c['source']} | {_num(c['paper'])} | "
                     f"{_num(c.get('ours'), c.get('std'))}{seeds_judged(c)}"
                     f" | {_num(c.get('difference'))} | **{c['verdict']}**{': ' + detail if detail else ''} |")
    lines += ["", ("ours: the mean over seeds (a gain: paired per seed; a best: the method's own value); difference: "
                   "ours - paper (a best: the margin to the next method); accuracies in percent points."), "",
              "Experiments (each command runs or resumes one by itself):", ""]
    for n, r in report["experiments"].items():
        lines.append(f"- `{n}` ({_state(r)}; cost: {r.get('cost') or 'not estimated'}): `{r['command']}`")
    return "\n".join(lines) + "\n"
