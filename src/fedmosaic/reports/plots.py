"""PNG plots: learning curves and the client x class bubble chart (pFedSRB Fig. 2 style)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..files import atomic_write  # noqa: E402

CURVE_KEYS = (("global", "global model, global test"), ("global_clients", "global model, client tests"),
              ("personal", "personalized, client tests"), ("cross", "intra-domain (solid), inter-domain (dashed)"),
              ("continual", "classes seen so far (no task id); | = task end"))


def _color(i: int, n: int):
    """The i-th of n lines' colour: matplotlib's ten defaults, or twenty (tab20) when ten would repeat."""
    return f"C{i % 10}" if n <= 10 else plt.get_cmap("tab20")(i % 20)


def learning_curves(runs: dict[str, list[dict]], path: str | Path, title: str = "") -> Path:
    """Test accuracy per round for each run (one panel per kind of accuracy present)."""
    kinds = [(k, label) for k, label in CURVE_KEYS if any(k in r for recs in runs.values() for r in recs)]
    fig, axes = plt.subplots(1, max(1, len(kinds)), figsize=(5.2 * max(1, len(kinds)), 3.8), squeeze=False)
    for ax, (key, label) in zip(axes[0], kinds):
        for i, (name, recs) in enumerate(runs.items()):
            fields = {"cross": (("intra_avg", "-"), ("inter_avg", "--")), "continual": (("seen_acc", "-o"),)}.get(
                key, (("acc", "-"),))
            for j, (field, style) in enumerate(fields):  # (the run's name on its first line only)
                pts = [(r["round"] + 1, 100 * r[key][field]) for r in recs if key in r]
                if pts:
                    ax.plot(*zip(*pts), style, color=_color(i, len(runs)), label=None if j else name, lw=1.6, ms=3)
            if key == "continual" and i == 0:
                for r in recs:
                    if r.get("continual", {}).get("task_end"):
                        ax.axvline(r["round"] + 1, color="grey", lw=0.6, alpha=0.5)
        ax.set(xlabel="round", ylabel="accuracy (%)", title=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _save(fig, path) -> Path:
    fig.tight_layout()
    try:
        return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)


def partition_bubbles(counts: np.ndarray, path: str | Path, title: str = "", max_clients: int = 100) -> Path:
    """Client x class bubble chart; bubble area ∝ sample count. Shows the first ``max_clients`` clients."""
    c = counts[:max_clients]
    k, n_cls = c.shape
    ys, xs = np.nonzero(c)
    fig, ax = plt.subplots(figsize=(min(14, 2 + 0.13 * k), min(9, 1.5 + 0.3 * n_cls)))
    area = 400 * c[ys, xs] / max(c.max(), 1)
    ax.scatter(ys, xs, s=area, alpha=0.6, color="tab:red", edgecolors="none")
    ax.set(xlabel="client", ylabel="class", xlim=(-1, k), ylim=(-1, n_cls))
    ax.set_title(title + (f" (first {k} of {len(counts)} clients)" if len(counts) > k else ""), fontsize=10)
    return _save(fig, path)


def accuracy_matrix(matrix, path: str | Path, title: str = "") -> Path:
    """The continual accuracy matrix: row i after task i, column j on the classes of task j (lower triangle)."""
    a = 100 * np.array([[np.nan if v is None else v for v in row] for row in matrix], dtype=float)
    ticks = [str(i + 1) for i in range(len(a))]
    return _heatmap(a, path, title, ticks, ("on the classes of task", "after task"), "{:.0f}", 20)


def accuracy_per_task(summaries: list[dict], path: str | Path, title: str = "") -> Path | None:
    """Class-incremental accuracy on every class seen so far after each task, one line per run summary that has it
    (``continual_seen``); None, and no file, when none has."""
    runs = {s["name"]: s["continual_seen"] for s in summaries if "continual_seen" in s}
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, seen) in enumerate(runs.items()):
        ax.plot(range(1, len(seen) + 1), [100 * v for v in seen], "-o", color=_color(i, len(runs)), label=name, lw=1.6,
                ms=3)
    ax.set(xlabel="task", ylabel="accuracy on the classes seen (%)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def cross_heatmap(matrix, path: str | Path, title: str = "", names: list[str] | None = None) -> Path:
    """The K x K cross-client accuracy matrix: row i client i's model, column j client j's test split."""
    a = 100 * np.asarray(matrix)
    labels = names if names is not None and len(names) == len(a) else [str(i) for i in range(len(a))]
    return _heatmap(a, path, title, labels, ("test split of client", "model of client"), "{:.1f}", 16)


def _heatmap(a: np.ndarray, path, title: str, labels: list[str], axes: tuple[str, str], fmt: str,
             annotate_up_to: int) -> Path:
    """A square accuracy heatmap (%, NaN cells blank), each cell written when there are few."""
    k = len(a)
    fig, ax = plt.subplots(figsize=(min(12, 4 + 0.6 * k), min(10, 3 + 0.55 * k)))
    im = ax.imshow(np.ma.masked_invalid(a), cmap="viridis", vmin=0, vmax=100)
    ax.set_xticks(range(k), labels, rotation=45 if k > 4 else 0, ha="right" if k > 4 else "center")
    ax.set_yticks(range(k), labels)
    if k <= annotate_up_to:
        for i in range(k):
            for j in range(k):
                if not np.isnan(a[i, j]):
                    ax.text(j, i, fmt.format(a[i, j]), ha="center", va="center", fontsize=8,
                            color="white" if a[i, j] < 60 else "black")
    ax.set(xlabel=axes[0], ylabel=axes[1])
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="accuracy (%)")
    return _save(fig, path)
