"""Plots (PNG, or PDF/SVG by the file's suffix): learning curves, the accuracy after each task, the objective's
parts and an algorithm's measures per round, the client x class bubble chart (pFedSRB Fig. 2 style) and the
accuracy heat maps.

Colours: ``method_colors(names)`` gives the i-th method the i-th colour. ``learning_curves`` and
``accuracy_per_task`` colour by the order in which the runs are given (a comparison's ``compare:`` order, the
order of `report`'s arguments), so the plots of one comparison, and a run's PNG and `report`'s PNG of the same runs
in the same order, colour each method alike; pass ``colors=method_colors(names)`` (or any name -> colour mapping
that covers every method drawn) to fix the colours whatever is drawn.

Seeds: where a method has several runs (one per seed), its curve is their mean at the rounds (tasks) that every
seed has, with a band of ± one sample standard deviation (n − 1) over the seeds."""

from __future__ import annotations

import textwrap
from collections.abc import Collection, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from ..files import atomic_write

CURVE_KEYS = (("global", "global model, global test"), ("global_clients", "global model, client tests"),
              ("personal", "personalized, client tests"), ("cross", "cross-client: models on client tests"),
              ("continual", "classes seen so far (no task id)"))
# the value(s) drawn for each kind of accuracy, with their line styles; "acc" for any kind not named
FIELDS = {"cross": (("intra_avg", "-"), ("inter_avg", "--")), "continual": (("seen_acc", "-"),)}
STYLES = {"cross": (("-", "intra-domain (solid)"), ("--", "inter-domain (dashed)"))}  # their legend entries


#: the second channel that tells methods apart (beside colour): the i-th method's marker. Seven, so methods i and
#: i + 10, which share one of the ten colours, never share a marker
MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def method_colors(names: Sequence[str]) -> dict[str, tuple]:
    """name -> colour for methods in this order: matplotlib's ten default colours, again from the eleventh method
    on (its marker, ``MARKERS`` in the same order, tells it apart: light shades and further hues were too close to
    tell). The i-th method's colour does not depend on how many methods there are, so a subset in the same order
    keeps its colours."""
    tab10 = plt.get_cmap("tab10").colors
    return {n: tab10[i % 10] for i, n in enumerate(dict.fromkeys(names))}


def _markers(colors: dict) -> dict[str, str]:
    """name -> marker, in the order of ``colors`` (the order that gave the colours)."""
    return {n: MARKERS[i % len(MARKERS)] for i, n in enumerate(colors)}


def _tex_safe(text: str) -> str:
    """Text matplotlib draws as written: a '$' in a method's name or a title would start mathtext."""
    return text.replace("$", r"\$")


def _mean_std(series: list[dict[int, float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, mean and sample standard deviation (0 for one series) over the series, at the x every series has."""
    xs = sorted(set.intersection(*(set(s) for s in series)))
    v = np.array([[s[x] for x in xs] for s in series], dtype=float).reshape(len(series), len(xs))
    return np.array(xs), v.mean(0), v.std(0, ddof=1) if len(series) > 1 else np.zeros(len(xs))


#: drawn at the last point of a curve whose run (or one of whose seeds) diverged: the curve ends there for a reason
DIVERGED = {"marker": "x", "color": "k", "ms": 8, "mew": 1.8, "ls": "", "zorder": 5}


def diverged(summaries: Sequence[dict]) -> set[str]:
    """The methods of these summaries (``compare.from_runs``'s) of which a run, or a seed, diverged."""
    return {s["name"] for s in summaries if s.get("diverged_round") is not None or s.get("diverged_seeds")}


def _line(ax, x, y, sd, color, style: str, marker: str, band: bool, bounds: tuple | None = None,
          stopped: bool = False) -> None:
    """One method's curve, its marker at about a dozen points (every point of a short run), and with ``band`` the
    ± std band, cut to ``bounds`` (accuracy: 0-100). A single point is a marker with an error bar (a band over one
    x has no width). ``stopped``: the run diverged after the last point, marked ``DIVERGED``."""
    if stopped and len(x):
        ax.plot(x[-1:], y[-1:], **DIVERGED)
    lo, hi = (y - sd, y + sd) if bounds is None else (np.clip(y - sd, *bounds), np.clip(y + sd, *bounds))
    if len(x) == 1:
        ax.errorbar(x, y, yerr=[y - lo, hi - y] if band else None, color=color, marker=marker, ms=5, capsize=3)
        return
    ax.plot(x, y, style, color=color, lw=1.6, marker=marker, ms=4, markevery=max(1, len(x) // 12))
    if band:
        ax.fill_between(x, lo, hi, color=color, alpha=0.2, lw=0)


def _one_x(ax, xs) -> None:
    """Ticks at the evaluated x when there are at most a dozen (every 5 rounds: 5, 10, ...), else integer ticks;
    around a single x, that x alone (MaxNLocator would tick 4.8, 4.9, ... around it)."""
    xs = sorted({int(x) for x in xs})
    if len(xs) == 1:
        ax.set_xlim(xs[0] - 1, xs[0] + 1)
    if 0 < len(xs) <= 12:
        ax.set_xticks(xs)
    else:
        _integer_ticks(ax.xaxis)


def _same_curves(ax, curves: dict) -> None:
    """Say in the panel which methods drew one and the same curve (FedAvg's and Ditto's global model), since the
    last drawn hides the others; ``curves``: name -> (x, mean, std)."""
    groups: list[list[str]] = []
    for name, (x, y, _) in curves.items():
        twin = next((g for g in groups if len(curves[g[0]][0]) == len(x) and np.array_equal(curves[g[0]][0], x)
                     and np.allclose(curves[g[0]][1], y)), None)
        if twin:
            twin.append(name)
        else:
            groups.append([name])
    same = ["one curve: " + ", ".join(g) for g in groups if len(g) > 1]
    if same:
        ax.text(0.01, 0.99, _tex_safe("\n".join(same)), transform=ax.transAxes, ha="left", va="top", fontsize=7,
                color="0.3")


def _legend(fig, methods: list[tuple[str, object, str, int]], extra: Sequence = ()) -> None:
    """One legend for the whole figure, below the panels: a line per method (name, colour, marker, seeds), the
    band when a method is over seeds, then ``extra`` (line styles, marks); as many columns as fit the width.
    The number of seeds is said once when every method has the same, else after each method's name."""
    seeds = {n for *_, n in methods}
    handles = [Line2D([], [], color=c, lw=1.6, marker=m, ms=4, label=_tex_safe(
        f"{name} ({n} seeds)" if n > 1 and len(seeds) > 1 else name)) for name, c, m, n in methods]
    if max(seeds, default=1) > 1:
        handles.append(Patch(color="grey", alpha=0.3, label="mean, band ± 1 std over " + (
            f"{seeds.pop()} seeds" if len(seeds) == 1 else "seeds")))
    handles += list(extra)
    if not handles:
        return
    longest = max(len(h.get_label()) for h in handles)  # ~0.065 in a character at 8 pt, plus the line's sample
    ncol = max(1, min(len(handles), int(fig.get_figwidth() / (0.6 + 0.065 * longest))))
    fig.set_figheight(fig.get_figheight() + 0.17 * -(-len(handles) // ncol))  # room for its rows, not the axes'
    fig.legend(handles=handles, loc="outside lower center", ncol=ncol, fontsize=8, frameon=False)


def _title(fig, title: str) -> None:
    """The figure's title, wrapped to the figure's width (~12 characters an inch at 10 pt) so it is never cut."""
    if title:
        fig.suptitle(_tex_safe(textwrap.fill(title, max(20, int(12 * fig.get_figwidth())))), fontsize=10)


def _integer_ticks(*axes) -> None:
    for axis in axes:
        axis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))  # 1, 2, 5, 10, 20, 50, ...


def learning_curves(runs: dict[str, list[dict] | list[list[dict]]], path: str | Path, title: str = "",
                    colors: dict[str, object] | None = None, *, exclusive: bool = False,
                    stopped: Collection[str] = ()) -> Path:
    """Test accuracy per round for each method, one panel per kind of accuracy present, one legend below them.

    ``runs``: method name -> its metrics records (one run), or a list of record lists (one per seed: the mean with
    a band of ± one std over the seeds, at the rounds every seed has). ``colors``: name -> colour, by default
    ``method_colors`` in the order of ``runs``; each method also has its marker (``MARKERS``, in that order), so
    two methods of the same curve (FedAvg's and Ditto's global model) both show. Task ends are marked in every
    panel, and the end of each curve of a method in ``stopped`` (it diverged there: ``diverged``)."""
    seeds = {name: recs if recs and isinstance(recs[0], list) else [recs] for name, recs in runs.items()}
    colors = colors or method_colors(list(runs))
    markers = _markers(colors)
    kinds = [(k, label) for k, label in CURVE_KEYS if any(k in r for s in seeds.values() for rs in s for r in rs)]
    fig, axes = plt.subplots(1, max(1, len(kinds)), figsize=(5.2 * max(1, len(kinds)), 4.2), squeeze=False, sharey=True,
                             layout="constrained")
    if not kinds:  # e.g. a run stopped before its first evaluation
        axes[0][0].text(0.5, 0.5, "no evaluated round", ha="center", va="center")
        axes[0][0].set_axis_off()
    curves = {}  # (name, key, field) -> x, mean, std over the seeds
    for name, s in seeds.items():
        for key, _ in kinds:
            for field, _ in FIELDS.get(key, (("acc", "-"),)):
                per_seed = [{r["round"] + 1: 100 * r[key][field] for r in rs
                             if key in r and r[key].get(field) is not None} for rs in s]
                if all(per_seed):
                    curves[name, key, field] = _mean_std(per_seed)
    ends = sorted({r["round"] + 1 for s in seeds.values() for rs in s for r in rs
                   if r.get("continual", {}).get("task_end")})
    for ax, (key, label) in zip(axes[0], kinds):
        for name, s in seeds.items():
            for field, style in FIELDS.get(key, (("acc", "-"),)):
                if (name, key, field) in curves:
                    _line(ax, *curves[name, key, field], colors[name], style, markers[name], len(s) > 1, (0, 100),
                          name in stopped)
        for field, _ in FIELDS.get(key, (("acc", "-"),)):
            _same_curves(ax, {n: c for (n, k, f), c in curves.items() if (k, f) == (key, field)})
        for x in ends:  # the rounds that end a task, in every panel (a grid line is lighter)
            ax.axvline(x, color="0.35", lw=0.8, ls=(0, (4, 3)), alpha=0.7)
        ax.set(xlabel="rounds completed", ylabel="accuracy (%)", title=label)
        _one_x(ax, [x for (_, k, _), c in curves.items() if k == key for x in c[0]])
        ax.grid(alpha=0.3)
    extra = [Line2D([], [], color="k", ls=ls, label=text) for key, _ in kinds for ls, text in STYLES.get(key, ())]
    if ends:
        extra.append(Line2D([], [], color="0.35", lw=0.8, ls=(0, (4, 3)), alpha=0.7, label="task end"))
    drawn = {n for n, *_ in curves}  # (a method with nothing to draw is not in the legend)
    extra += _stopped_mark(drawn & set(stopped))
    _legend(fig, [(name, colors[name], markers[name], len(s)) for name, s in seeds.items() if name in drawn], extra)
    _title(fig, title)
    return _save(fig, path, exclusive=exclusive)


def accuracy_per_task(summaries: list[dict | list[dict]], path: str | Path, title: str = "",
                      colors: dict[str, object] | None = None, *, exclusive: bool = False) -> Path | None:
    """Class-incremental accuracy on every class seen so far after each task (``continual_seen``), one line per
    method that has it; None, and no file, when none has.

    Each item of ``summaries`` is one method's summary, or a list of its summaries (one per seed: the mean with a
    band of ± one std over the seeds, at the tasks every seed reached). A summary already over seeds (as
    ``compare.over_seeds`` makes: ``continual_seen_std`` and ``seeds``) is drawn with its band too. ``colors``:
    name -> colour, by default ``method_colors`` in the order of ``summaries`` (all of them, with or without
    ``continual_seen``, so the colours agree with ``learning_curves`` of the same runs)."""
    groups = [s if isinstance(s, list) else [s] for s in summaries]
    colors = colors or method_colors([g[0]["name"] for g in groups])
    markers, xs = _markers(colors), []
    fig = ax = None
    methods = []
    for g in groups:
        seen = [s["continual_seen"] for s in g if "continual_seen" in s]
        if not seen:
            continue
        if fig is None:
            fig, ax = plt.subplots(figsize=(6.4, 4.6), layout="constrained")
        x, mean, sd = _mean_std([dict(enumerate(v, 1)) for v in seen])
        n = len(seen)
        if n == 1 and "continual_seen_std" in g[0]:  # a summary over seeds
            n, sd = g[0].get("seeds", 1), np.asarray(g[0]["continual_seen_std"], dtype=float)
        name = g[0]["name"]
        methods.append((name, colors[name], markers[name], n))
        _line(ax, x, 100 * mean, 100 * sd, colors[name], "-", markers[name], n > 1, (0, 100))
        xs += list(x)
    if fig is None:
        return None
    ax.set(xlabel="task", ylabel="accuracy on the classes seen (%)")
    _one_x(ax, xs)
    ax.grid(alpha=0.3)
    _legend(fig, methods)
    _title(fig, title)
    return _save(fig, path, exclusive=exclusive)


def _stopped_mark(names: set[str]) -> list:
    """The legend's entry for ``DIVERGED``, when a drawn method has it."""
    return [Line2D([], [], **DIVERGED, label="diverged after its last point")] if names else []


def diagnostics(runs: dict[str, list[dict] | list[list[dict]]], path: str | Path, title: str = "",
                colors: dict[str, object] | None = None, *, exclusive: bool = False,
                stopped: Collection[str] = ()) -> Path | None:
    """One small panel per named part of the local objective (``terms``, every round) and per measure an algorithm
    reports (``report``, with every evaluation, or every ``eval.report_every`` rounds): ProtoFCL's L_C, L_D, L_R,
    teacher entropy and prototype geometry, a sparsity, ... — one line per method that has it (the mean over
    seeds with a band), so a collapse or a term that does nothing is seen, not inferred. ``runs`` and ``colors``
    as :func:`learning_curves` (a diverged run's blow-up is often seen here first). None, and no file, when no run
    has any."""
    seeds = {name: recs if recs and isinstance(recs[0], list) else [recs] for name, recs in runs.items()}
    keys = list(dict.fromkeys((kind, k) for s in seeds.values() for rs in s for r in rs
                              for kind in ("terms", "report") for k in r.get(kind, {})))
    if not keys:
        return None
    colors = colors or method_colors(list(runs))
    markers = _markers(colors)
    ends = sorted({r["round"] + 1 for s in seeds.values() for rs in s for r in rs
                   if r.get("continual", {}).get("task_end")})
    cols = min(4, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False, layout="constrained")
    drawn = {}
    for ax, (kind, key) in zip(axes.flat, keys):
        for name, s in seeds.items():
            per_seed = [{r["round"] + 1: r[kind][key] for r in rs if key in r.get(kind, {})} for rs in s]
            if all(per_seed):
                x, mean, sd = _mean_std(per_seed)
                _line(ax, x, mean, sd, colors[name], "-", markers[name], len(s) > 1, stopped=name in stopped)
                drawn[name] = (markers[name], len(s))
        for x in ends:  # a task's start resets what these measure: marked, not left to be guessed
            ax.axvline(x, color="0.35", lw=0.8, ls=(0, (4, 3)), alpha=0.7)
        ax.set(xlabel="rounds completed", title=_tex_safe(key + (" (per round)" if kind == "terms" else " (reported)")))
        ax.title.set_fontsize(9)
        _integer_ticks(ax.xaxis)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_axis_off()
    _legend(fig, [(name, colors[name], *drawn[name]) for name in seeds if name in drawn],
            _stopped_mark(set(drawn) & set(stopped)))
    _title(fig, title)
    return _save(fig, path, exclusive=exclusive)


#: the formats a plot is written in, by the file's suffix (anything else: PNG)
FORMATS = ("png", "pdf", "svg")


def _save(fig, path, exclusive: bool = False) -> Path:
    """In the format its suffix names (``FORMATS``: a PDF or SVG for a paper; PNG at 150 dpi otherwise).
    ``exclusive``: FileExistsError rather than replace a file that appeared since the caller looked."""
    kind = Path(path).suffix.lower().lstrip(".")
    kind = kind if kind in FORMATS else "png"
    try:
        return atomic_write(path, lambda f: fig.savefig(f, format=kind, dpi=150), exclusive=exclusive)
    finally:
        plt.close(fig)


def partition_bubbles(counts: np.ndarray, path: str | Path, title: str = "", max_clients: int = 100) -> Path:
    """Client x class bubble chart; bubble area ∝ sample count, with a legend of reference sizes. Shows the first
    ``max_clients`` clients."""
    c = np.asarray(counts)[:max_clients]
    k, n_cls = c.shape
    w, h = min(14, max(6.0, 3.5 + 0.11 * k)), min(9, max(3.5, 1.8 + 0.3 * n_cls))
    fig, ax = plt.subplots(figsize=(w, h), layout="constrained")
    # the largest bubble spans ~1.5 cells of the client x class grid (axes ~ w - 2.5 by h - 1.8 inches): only two
    # large neighbours touch, however many clients; 8 to 20 pt across
    diameter = float(np.clip(1.5 * 72 * min((w - 2.5) / k, (h - 1.8) / n_cls), 8, 20))
    top = max(int(c.max()), 1)
    ys, xs = np.nonzero(c)
    # area ∝ count, but never below 3 pt across: a client's few samples beside a class of thousands stay visible
    sc = ax.scatter(ys, xs, s=np.maximum(diameter ** 2 * c[ys, xs] / top, 9.0), alpha=0.6, color="tab:red",
                    edgecolors="none")
    ax.set(xlabel="client", ylabel="class", xlim=(-0.7, k - 0.3), ylim=(-0.7, n_cls - 0.3))
    _integer_ticks(ax.xaxis, ax.yaxis)
    for axis, n in ((ax.xaxis, k), (ax.yaxis, n_cls)):
        if n <= 20:  # every client, every class, when they fit
            axis.set_ticks(range(n))
    if len(ys):  # (no sample at all: no sizes to show)
        handles, labels = sc.legend_elements("sizes", num=4, func=lambda s: s / diameter ** 2 * top, fmt="{x:.0f}",
                                             alpha=0.6, color="tab:red", markeredgewidth=0)
        fig.legend(handles, labels, loc="outside right upper", title="samples", fontsize=8, title_fontsize=8,
                   frameon=False, labelspacing=max(0.5, diameter / 16))
    _title(fig, title + (f" (first {k} of {len(counts)} clients)" if len(counts) > k else ""))
    return _save(fig, path)


def accuracy_matrix(matrix, path: str | Path, title: str = "") -> Path:
    """The continual accuracy matrix: row i after task i, column j on the classes of task j (lower triangle)."""
    a = 100 * np.array([[np.nan if v is None else v for v in row] for row in matrix], dtype=float)
    ticks = [str(i + 1) for i in range(len(a))]
    return _heatmap(a, path, title, ticks, ("on the classes of task", "after task"), "{:.0f}")


def cross_heatmap(matrix, path: str | Path, title: str = "", names: list[str] | None = None) -> Path:
    """The K x K cross-client accuracy matrix: row i client i's model, column j client j's test split."""
    a = 100 * np.asarray(matrix)
    labels = names if names is not None and len(names) == len(a) else [str(i) for i in range(len(a))]
    return _heatmap(a, path, title, labels, ("test split of client", "model of client"), "{:.1f}")


def _heatmap(a: np.ndarray, path, title: str, labels: list[str], axes: tuple[str, str], fmt: str) -> Path:
    """A square accuracy heatmap (%, NaN cells blank), each cell written where its number fits at >= 6 pt."""
    k = len(a)
    w, h = min(12, 4.5 + 0.6 * k), min(10, 3.5 + 0.55 * k)
    fig, ax = plt.subplots(figsize=(w, h), layout="constrained")
    im = ax.imshow(np.ma.masked_invalid(a), cmap="viridis", vmin=0, vmax=100)
    # at most 25 tick labels, every one when they fit, else numbers that are multiples of 2, 5, 10, 20, 50, ...
    step = next(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, k) if k <= 25 * s)
    ticks = [i for i, name in enumerate(labels) if (int(name) if name.isdigit() else i) % step == 0]
    shown = [labels[i] for i in ticks]
    # rotated when the labels are wider than their cells (~0.065 in a character at the tick labels' size)
    rotate = max(map(len, shown)) > 2 and 0.065 * max(map(len, shown)) > (w - 2.5) / k
    ax.set_xticks(ticks, shown, rotation=45 if rotate else 0, ha="right" if rotate else "center")
    ax.set_yticks(ticks, shown)
    cell_pt = 72 * min(w - 2.5, h - 1.8) / k  # the axes are about w - 2.5 by h - 1.8 inches
    size = min(10.0, cell_pt / (0.6 * len(fmt.format(100.0)) + 0.8))  # a digit is ~0.6 em wide, plus a margin
    if size >= 6:
        for i, j in zip(*np.nonzero(~np.isnan(a))):
            ax.text(j, i, fmt.format(a[i, j]), ha="center", va="center", fontsize=size,
                    color="white" if a[i, j] < 60 else "black")
    ax.set(xlabel=axes[0], ylabel=axes[1])
    fig.colorbar(im, ax=ax, label="accuracy (%)", shrink=0.9)
    _title(fig, title)
    return _save(fig, path)
