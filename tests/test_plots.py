"""The PNG plots, checked through their matplotlib figures: integer ticks on integer axes, one legend outside the
data with every line style, one colour per method across plots, markers on short runs, bands over seeds, the
partition chart's size legend and title."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgba

from fedmosaic.reports import plots


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions would save, drawn (so that their layout is done), instead of PNG files."""
    drawn = []

    def keep(fig, path, exclusive=False):
        fig.canvas.draw()
        drawn.append(fig)
        return path
    monkeypatch.setattr(plots, "_save", keep)
    yield drawn
    for fig in drawn:
        plots.plt.close(fig)


def records(rounds: int, seed: int = 0, cross: bool = False, tasks: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for t in range(rounds):
        r = {"round": t, "global": {"acc": float(rng.uniform(0.2, 0.9))}}
        if cross:
            r["cross"] = {"intra_avg": float(rng.uniform(0.5, 0.9)), "inter_avg": float(rng.uniform(0.1, 0.5))}
        if tasks:
            r["continual"] = {"seen_acc": float(rng.uniform(0.3, 0.9)), "task_end": (t + 1) % (rounds // tasks) == 0}
        out.append(r)
    return out


def integer_ticks(axis) -> bool:
    lo, hi = sorted(axis.get_view_interval())
    ticks = [t for t in axis.get_ticklocs() if lo <= t <= hi]
    return len(ticks) >= 2 and all(float(t).is_integer() for t in ticks)


def inside(inner, outer) -> bool:
    return (inner.x0 >= outer.x0 - 0.5 and inner.y0 >= outer.y0 - 0.5 and inner.x1 <= outer.x1 + 0.5
            and inner.y1 <= outer.y1 + 0.5)


def test_round_task_client_and_class_axes_have_integer_ticks(figures, tmp_path):
    plots.learning_curves({"a": records(3, cross=True)}, tmp_path / "c.png")
    plots.accuracy_per_task([{"name": "a", "continual_seen": [0.9, 0.7, 0.6]}], tmp_path / "t.png")
    plots.partition_bubbles(np.array([[5, 0, 3], [1, 9, 0], [2, 2, 2]]), tmp_path / "p.png")
    curves, tasks, bubbles = figures
    assert all(integer_ticks(ax.xaxis) for ax in curves.axes)  # rounds 1..3: no 1.5, 2.5
    assert integer_ticks(tasks.axes[0].xaxis)
    assert integer_ticks(bubbles.axes[0].xaxis) and integer_ticks(bubbles.axes[0].yaxis)
    assert min(bubbles.axes[0].get_xticks()[bubbles.axes[0].get_xticks() >= -0.7]) == 0  # no client -1


def test_one_legend_outside_the_panels_names_every_method_and_both_cross_line_styles(figures, tmp_path):
    plots.learning_curves({"a": records(5, cross=True, tasks=5), "b": records(5, 1, cross=True, tasks=5)},
                          tmp_path / "c.png")
    fig = figures[0]
    assert len(fig.legends) == 1 and not any(ax.get_legend() for ax in fig.axes)
    legend = fig.legends[0]
    labels = [t.get_text() for t in legend.get_texts()]
    assert {"a", "b", "intra-domain (solid)", "inter-domain (dashed)", "task end"} <= set(labels)
    styles = {h.get_label(): h.get_linestyle() for h in legend.legend_handles}
    assert styles["intra-domain (solid)"] == "-" and styles["inter-domain (dashed)"] == "--"
    box = legend.get_window_extent()
    assert inside(box, fig.bbox)
    assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes)


def line_colors(fig) -> list[tuple]:
    return [to_rgba(line.get_color()) for line in fig.axes[0].lines]


def test_a_method_has_the_same_colour_in_every_plot_and_whatever_follows_it(figures, tmp_path):
    names = [f"m{i}" for i in range(12)]
    plots.learning_curves({n: records(4, i) for i, n in enumerate(names[:2])}, tmp_path / "two.png")
    plots.learning_curves({n: records(4, i) for i, n in enumerate(names)}, tmp_path / "twelve.png")
    # the per-task plot of the same comparison, where the first method has no continual accuracy
    plots.accuracy_per_task([{"name": "m0"}, {"name": "m1", "continual_seen": [0.9, 0.8]}], tmp_path / "t.png")
    two, twelve, tasks = map(line_colors, figures)
    assert two[1] == twelve[1] == tasks[0]
    styles = list(zip(twelve, (line.get_marker() for line in figures[1].axes[0].lines), strict=True))
    assert len(set(twelve)) == 10 and len(set(styles)) == 12  # ten colours, then the marker tells them apart
    # and each legend shows the colours and markers of the lines
    for fig in figures:
        handles = [h for h in fig.legends[0].legend_handles if h.get_label().startswith("m")]
        assert [(to_rgba(h.get_color()), h.get_marker()) for h in handles] == [
            (to_rgba(line.get_color()), line.get_marker()) for line in fig.axes[0].lines]


def test_explicit_colours_are_used(figures, tmp_path):
    plots.learning_curves({"a": records(4)}, tmp_path / "c.png", colors={"a": "black"})
    assert to_rgba(figures[0].axes[0].lines[0].get_color()) == to_rgba("black")


def test_two_methods_of_one_curve_both_show_and_a_long_run_has_a_dozen_markers(figures, tmp_path):
    same = records(120)  # e.g. FedAvg's and Ditto's global model: one curve
    plots.learning_curves({"fedavg": same, "ditto": same}, tmp_path / "s.png")
    a, b = figures[0].axes[0].lines
    assert a.get_marker() != b.get_marker() and a.get_markevery() == b.get_markevery() == 10
    assert [t.get_text() for t in figures[0].axes[0].texts] == ["one curve: fedavg, ditto"]  # (b hides a)


def test_a_single_round_is_a_point_with_its_error_bar_bands_stay_within_0_and_100_and_tasks_end_everywhere(
        figures, tmp_path):
    one = [[{"round": 4, "global": {"acc": a}}] for a in (0.5, 0.7)]
    plots.learning_curves({"a": one}, tmp_path / "one.png")
    ax = figures[0].axes[0]
    assert list(ax.get_xticks()) == [5] and ax.containers  # an error bar, and no 4.8, 4.9, ... ticks
    high = [[{"round": t, "global": {"acc": a}, "continual": {"seen_acc": a, "task_end": t == 1}}
             for t in range(3)] for a in (0.99, 0.6)]
    plots.learning_curves({"b": high, "$x$": records(3)}, tmp_path / "high.png")
    fig = figures[1]
    band = next(c for c in fig.axes[0].collections if isinstance(c, PolyCollection))
    assert band.get_paths()[0].vertices[:, 1].max() <= 100
    assert all(any(line.get_xdata()[0] == 2 for line in panel.lines[-1:]) for panel in fig.axes)  # task end
    assert r"\$x\$" in [t.get_text() for t in fig.legends[0].get_texts()]  # drawn as written, not as maths


def test_seeds_are_drawn_as_their_mean_with_a_band_of_one_std_at_the_rounds_every_seed_has(figures, tmp_path):
    seeds = [records(5, 0), records(5, 1), records(4, 2)]  # the last seed stopped after 4 rounds
    plots.learning_curves({"a": seeds, "b": records(5, 3)}, tmp_path / "c.png")
    fig = figures[0]
    ax = fig.axes[0]
    acc = np.array([[100 * r["global"]["acc"] for r in s[:4]] for s in seeds])
    mean, sd = acc.mean(0), acc.std(0, ddof=1)
    line_a, line_b = ax.lines
    assert list(line_a.get_xdata()) == [1, 2, 3, 4] and np.allclose(line_a.get_ydata(), mean)
    assert len(line_b.get_xdata()) == 5  # one run, as before
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1  # for the seeded method only
    ys = bands[0].get_paths()[0].vertices[:, 1]
    assert np.isclose(ys.max(), (mean + sd).max()) and np.isclose(ys.min(), (mean - sd).min())
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "a (3 seeds)" in labels and any("± 1 std" in t for t in labels)


def test_accuracy_per_task_draws_a_band_for_seeds_given_as_lists_or_as_an_aggregated_summary(figures, tmp_path):
    per_seed = [{"name": "a", "continual_seen": [0.9, 0.8, 0.7]}, {"name": "a", "continual_seen": [0.8, 0.6, 0.5]}]
    aggregated = {"name": "b", "seeds": 3, "continual_seen": [0.9, 0.8], "continual_seen_std": [0.05, 0.1]}
    plots.accuracy_per_task([per_seed, aggregated, {"name": "c", "continual_seen": [0.5, 0.4]}], tmp_path / "t.png")
    ax = figures[0].axes[0]
    assert np.allclose(ax.lines[0].get_ydata(), [85, 70, 60])
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 2  # a and b, not the single run c
    assert np.allclose(sorted(set(bands[1].get_paths()[0].vertices[:, 1])), [70, 85, 90, 95])  # (90, 80) ± (5, 10)


def partition(k: int, classes: int = 10) -> np.ndarray:
    rng = np.random.default_rng(0)
    return (rng.dirichlet([0.3] * classes, k) * rng.integers(50, 500, (k, 1))).astype(int)


@pytest.mark.parametrize("clients", [2, 3, 100])
def test_the_partition_chart_has_a_size_legend_and_a_title_inside_the_figure(figures, tmp_path, clients):
    counts = partition(clients)
    title = f"fmnist · dirichlet(alpha=0.3, min_size=10) · {clients} clients · seed 0 · a long title"
    plots.partition_bubbles(counts, tmp_path / "p.png", title=title)
    fig = figures[0]
    shown = fig._suptitle if fig._suptitle is not None else fig.axes[0].title
    assert inside(shown.get_window_extent(), fig.bbox)
    assert shown.get_text().replace("\n", " ") == title
    (legend,) = fig.legends
    assert legend.get_title().get_text() == "samples"
    values = [float(t.get_text()) for t in legend.get_texts()]
    sizes = [h.get_markersize() ** 2 for h in legend.legend_handles]
    assert len(values) >= 2 and values == sorted(values)
    # a reference bubble has the area a cell with that many samples has in the chart
    scatter = fig.axes[0].collections[0]
    per_sample = scatter.get_sizes().max() / counts.max()
    assert np.allclose(np.array(sizes) / np.array(values), per_sample, rtol=1e-6)
    assert inside(legend.get_window_extent(), fig.bbox)


def heat_texts(fig):
    return list(fig.axes[0].texts)


def test_heat_maps_have_integer_tick_labels_and_annotations_sized_to_their_cells(figures, tmp_path):
    rng = np.random.default_rng(0)
    plots.accuracy_matrix([[0.5, None, None], [0.4, 0.9, None], [0.3, 0.8, 0.7]], tmp_path / "m3.png")
    plots.cross_heatmap(rng.uniform(size=(16, 16)), tmp_path / "c16.png")
    plots.cross_heatmap(rng.uniform(size=(100, 100)), tmp_path / "c100.png")
    small, large, huge = figures
    assert [t.get_text() for t in small.axes[0].get_xticklabels()] == ["1", "2", "3"]
    assert len(heat_texts(small)) == 6  # the lower triangle, no text in the blank cells
    assert len(heat_texts(large)) == 16 * 16
    assert heat_texts(small)[0].get_fontsize() > heat_texts(large)[0].get_fontsize() >= 6
    labels = [t.get_text() for t in huge.axes[0].get_xticklabels()]
    assert len(labels) <= 25 and all(int(t) % 5 == 0 for t in labels)
    assert not heat_texts(huge)  # cells too small to write in


def test_diagnostics_draws_each_term_and_reported_measure_per_method_and_nothing_without_them(figures, tmp_path):
    a, b = records(4), records(4, 1)
    for t, r in enumerate(a):
        r["terms"] = {"l_c": 1.0 + t, "teacher_entropy": 0.1 * t}
        if t % 2:
            r["report"] = {"proto_inter": 4.0 - t}  # every other round: reported with evaluations
    for r in b:
        r["terms"] = {"l_c": 0.5}
    assert plots.diagnostics({"a": a, "b": b}, tmp_path / "d.png") is not None
    fig = figures[0]
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible() and ax.axison]
    assert titles == ["l_c (per round)", "teacher_entropy (per round)", "proto_inter (reported)"]
    lc, entropy, inter = (ax for ax in fig.axes if ax.axison)
    assert len(lc.lines) == 2 and len(entropy.lines) == 1  # b has no teacher entropy
    assert list(inter.lines[0].get_xdata()) == [2, 4] and list(inter.lines[0].get_ydata()) == [3.0, 1.0]
    assert plots.diagnostics({"a": records(3)}, tmp_path / "none.png") is None and len(figures) == 1


def test_the_accuracy_panels_share_one_y_range(figures, tmp_path):
    plots.learning_curves({"a": records(6, cross=True, tasks=2)}, tmp_path / "c.png")
    limits = {tuple(round(v, 6) for v in ax.get_ylim()) for ax in figures[0].axes if ax.get_visible()}
    assert len(figures[0].axes) >= 2 and len(limits) == 1  # one scale: panels compare at a glance


def test_a_diverged_method_is_marked_at_the_end_of_each_of_its_curves_and_in_the_legend(figures, tmp_path):
    a, b = records(6), records(4, 1)  # b diverged after its 4th round
    for r in a + b:
        r["terms"] = {"l_c": 1.0}
    stopped = plots.diverged([{"name": "a"}, {"name": "b", "diverged_round": 4}])
    assert stopped == {"b"} and plots.diverged([{"name": "c", "diverged_seeds": 1.0}]) == {"c"}
    plots.learning_curves({"a": a, "b": b}, tmp_path / "c.png", stopped=stopped)
    plots.diagnostics({"a": a, "b": b}, tmp_path / "d.png", stopped=stopped)
    for fig in figures:
        ax = next(ax for ax in fig.axes if ax.axison)
        marks = [ln for ln in ax.lines if ln.get_marker() == plots.DIVERGED["marker"]]
        assert len(marks) == 1 and list(marks[0].get_xdata()) == [4]  # b's last point, nothing on a's
        assert "diverged after its last point" in [t.get_text() for t in fig.legends[0].get_texts()]
    plots.learning_curves({"a": a}, tmp_path / "e.png", stopped=stopped)  # b not drawn: no mark, no legend entry
    assert "diverged after its last point" not in [t.get_text() for t in figures[-1].legends[0].get_texts()]
