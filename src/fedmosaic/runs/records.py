"""The metrics records of a run: ``metrics.jsonl`` read back line by line with every line checked for the shape
summaries, tables and plots read (a damaged line ends them), the headline summary (never best-on-test), and the
flat exports (``scalars``, ``metrics.csv``)."""

from __future__ import annotations

import csv
import io
import json
import warnings
from pathlib import Path

import numpy as np

from ..config import RunConfig
from ..files import atomic_write
from .continual import continual_summary

TIMING_KEYS = ("time_round_s", "time_eval_s")


def rounds_recorded(out: Path) -> int:
    """How many rounds ``metrics.jsonl`` holds, by its lines, without reading them (how far a run has got)."""
    p = out / "metrics.jsonl"
    return sum(1 for line in p.read_bytes().splitlines() if line.strip()) if p.is_file() else 0


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
            and _numbers(c.get("inter"), K, none=True)
            and all(k in c and (_number(c[k]) or c[k] is None) for k in ("intra_avg", "inter_avg"))
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
    start = rec.get("start", {})  # (eval.start: the evaluation before the first round, in round 0's line)
    if not isinstance(start, dict) or (start and rec["round"] != 0):
        return False
    first = next((r["global"] for r in before if "global" in r), None)  # (its classes fix class_acc's length)
    for part in (rec, start):
        for key in ("global_clients", "global_val", "personal", "personal_val"):
            if key in part and not (isinstance(part[key], dict)
                                    and all(_number(part[key].get(s)) for s in _CLIENT_STATS)):
                return False
        g = part.get("global")
        if "global" in part and not (isinstance(g, dict) and _number(g.get("acc")) and _numbers(
                g.get("class_acc"), None if first is None else len(first["class_acc"]), none=True)):
            return False
    return (all(_table(rec[k]) for k in ("terms", "report") if k in rec)
            and all(_numbers(rec[k]) for k in ("cohort", "dropped") if k in rec)
            and ("cross" not in rec or _cross(rec["cross"]))
            and ("continual" not in rec or _continual(rec["continual"], before))
            and ("privacy" not in rec or (isinstance(rec["privacy"], dict) and _number(rec["privacy"].get("delta"))
                                          and (rec["privacy"].get("epsilon") is None
                                               or _number(rec["privacy"]["epsilon"])))))


def summarize(records: list[dict], cfg: RunConfig) -> dict:
    """Headline numbers. Never "best on test": the best round is chosen on validation accuracy when there is one."""
    ev = [r for r in records if any(k in r for k in ("global", "global_clients", "personal", "continual"))]
    out: dict = {"name": cfg.name, "algorithm": cfg.algorithm.name, "rounds": len(records)}
    for key in ("global", "global_clients", "personal"):
        accs = [r[key]["acc"] for r in ev if key in r]
        if accs:
            out[f"{key}_acc_final"] = accs[-1]
            out[f"{key}_acc_mean"] = float(np.mean(accs))
            if key in records[0].get("start", {}):  # (eval.start) the starting model's too: the FedProx convention
                out[f"{key}_acc_mean_from_start"] = float(np.mean([records[0]["start"][key]["acc"], *accs]))
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
    cross = [r["cross"] for r in ev if "cross" in r][-3:]  # AHF's protocol: the mean of the last 3 evaluations
    for key, name in (("intra_avg", "intra_last3"), ("inter_avg", "inter_last3")):
        values = [c[key] for c in cross if c[key] is not None]  # (None: no client had one)
        if values:
            out[name] = float(np.mean(values))
    if ev and "report" in ev[-1]:  # the algorithm's own measures (e.g. sparsity of personal parts)
        out.update({f"{k}_final": v for k, v in ev[-1]["report"].items()})
    end_records = [r for r in ev if r.get("continual", {}).get("task_end")]
    ends = [r["continual"] for r in end_records]
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
        out["continual_per_task"] = per_task(records, end_records)
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


def per_task(records: list[dict], ends: list[dict]) -> list[dict[str, float]]:
    """Per task of a class-incremental run: the accuracy on the classes seen so far (``seen``), the algorithm's
    report at the task's last round (e.g. ProtoFCL's prototype geometry) and each loss term's mean over the task's
    rounds (``<term>_mean``, e.g. the teacher's entropy); ``ends``: the evaluation records ending each task."""
    out, start = [], -1
    for end in ends:
        rounds = [r for r in records if start < r["round"] <= end["round"]]
        terms = [r["terms"] for r in rounds if "terms" in r]
        names = dict.fromkeys(n for t in terms for n in t)
        out.append({"seen": end["continual"]["seen_acc"], **end.get("report", {}),
                    **{f"{n}_mean": float(np.mean([t[n] for t in terms if n in t])) for n in names}})
        start = end["round"]
    return out


def forgetting(class_acc_history: list[list[float | None]]) -> float | None:
    """FedNTD eq. 5: F = (1/C) Σ_c max_{t<T} (A_c^t − A_c^T), from the global model's per-class test accuracy,
    over the C classes the test split has samples of (None: a class without; the split is the same every round)."""
    a = np.array(class_acc_history, dtype=np.float64)  # (None -> NaN)
    judged = ~np.isnan(a).any(0)
    return float((a[:-1, judged].max(0) - a[-1, judged]).mean()) if judged.any() else None


def scalars(rec: dict, sep: str = ".", at: str = "") -> dict[str, float]:
    """The numbers of a metrics record by their path (``global.acc``, ``continual.tasks.0``, ``terms.kd``); the
    per-class accuracies, the cross-client matrix and the lists of client ids are left out (too wide for one row,
    and ids are not measurements)."""
    out: dict[str, float] = {}
    items = rec.items() if isinstance(rec, dict) else enumerate(rec)
    for k, v in items:
        key = f"{at}{sep}{k}" if at else str(k)
        if k in ("class_acc", "matrix", "names", "intra", "inter", "cohort", "dropped"):
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


