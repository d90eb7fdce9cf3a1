"""The bench picture reads right: the legend off the data, labels off the error bars, the
projected curve and the measured points explained on the plot."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from rankwise.bench import plot


def _doc() -> dict:
    # On CPU the measured efficiencies sit at 0.03-0.2: where the old lower-left legend was.
    rows = [
        {"name": "single", "available": True, "exact": True, "samples_per_s": 1000.0,
         "speedup": 1.0, "step_ms": {"min": 50.0, "max": 90.0}},
        {"name": "threads", "available": True, "exact": True, "samples_per_s": 1500.0,
         "speedup": 1.5, "step_ms": {"min": 30.0, "max": 60.0}},
        {"name": "ddp", "available": True, "exact": True, "samples_per_s": 400.0,
         "speedup": 0.4, "step_ms": {"min": 100.0, "max": 220.0}},
    ]
    curve = [{"world": w, "efficiency": e} for w, e in
             [(2, 0.2), (8, 0.1), (32, 0.06), (128, 0.04), (256, 0.03)]]
    checks = [{"world": 2, "efficiency": 0.05, "modelled_efficiency": 0.2},
              {"world": 3, "efficiency": 0.03, "modelled_efficiency": 0.15}]
    return {
        "config": {"model": "cnn", "nproc": 2, "global_batch": 64},
        "strategies": rows,
        "recommendation": {"strategy": "threads"},
        "projection": {"curve": curve, "validation": {"rows": checks},
                       "network": {"source": "measured"}},
    }


def _drawn():
    fig = plot.draw(_doc())
    fig.canvas.draw()
    return fig, fig.canvas.get_renderer()


def test_the_legend_covers_no_data_point():
    fig, renderer = _drawn()
    right = fig.axes[1]
    legend = right.get_legend().get_window_extent(renderer)
    points = [(c["world"], c["efficiency"]) for c in _doc()["projection"]["curve"]]
    for check in _doc()["projection"]["validation"]["rows"]:
        points += [(check["world"], check["efficiency"]), (check["world"], check["modelled_efficiency"])]
    for x, y in right.transData.transform(points):
        assert not legend.contains(x, y), f"the legend covers the point at ({x:.0f}, {y:.0f})"
    assert not legend.overlaps(right.get_window_extent(renderer))  # below the axes entirely


def test_value_labels_sit_above_their_error_bars():
    fig, renderer = _drawn()
    left = fig.axes[0]
    labels = [t for t in left.texts if t.get_text().endswith("x")]
    doc = _doc()
    gb = doc["config"]["global_batch"] * 1e3
    for i, (text, row) in enumerate(zip(labels, doc["strategies"], strict=True)):
        top = gb / row["step_ms"]["min"]  # the error bar's upper cap: the fastest repeat
        _, cap_y = left.transData.transform((i, top))
        assert text.get_window_extent(renderer).y0 >= cap_y - 0.5, row["name"]


def test_the_plot_says_what_the_curve_and_the_points_are():
    fig, _ = _drawn()
    words = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    assert "compute term = the one-process step measured here" in words
    assert "hollow: the model's value for the same run" in words
