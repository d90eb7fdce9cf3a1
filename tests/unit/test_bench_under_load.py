"""``rankwise bench`` fed measurements a loaded machine produces (``independent`` slower than
``ddp``): no negative figure in the table, the recommendation or the picture, the confidence is
lowered and says why; in the picture, a modelled point off the projected curve is labelled
where it sits."""

from __future__ import annotations

import re

import pytest

from rankwise.bench import report
from rankwise.bench.runner import BenchConfig

NEGATIVE = re.compile(r"(?<![\w.)])[-\u2212]\s?\d")
"""A number with a minus sign (not the dash of a range such as 50.4-63.6)."""

GRAD_BYTES = 4 * 1_000_000


def _times(median: float) -> list[float]:
    return [median * f for f in (0.97, 0.99, 1.0, 1.02, 1.04)]


def _raw(independent_ms: float) -> dict:
    """The runner's output for a 2-process run; ``independent`` at ``independent_ms``.
    ddp 65 ms, torch-ddp 80 ms: with independent at 230 ms (a load spike during its runs),
    their "communication" would be -165 and -150 ms."""
    steps = {"single": 60.0, "threads": 40.0, "dp": 90.0, "ddp": 65.0, "torch-ddp": 80.0,
             "independent": independent_ms}
    memory = {n: {"peak_mb": [50.0, 48.0], "loss": 2.3, "memory_method": "VmHWM"} for n in steps}
    fit = {"alpha_us": 300.0, "bandwidth_GBps": 1.2, "source": "measured"}
    return {
        "names": list(steps),
        "skipped": {},
        "device": "cpu",
        "backend": "gloo",
        "main": {"times": {n: _times(t) for n, t in steps.items()}, "memory_loss": memory,
                 "comm": {"fit": fit, "memcpy_GBps": 2.7, "rows": []}},
        "validation": {2: {"independent_ms": independent_ms, "ddp_ms": 65.0, "strategy": "ddp"},
                       3: {"independent_ms": 1.5 * independent_ms, "ddp_ms": 110.0,
                           "strategy": "ddp"}},
        "seconds": 60.0,
        "loadavg_1m": [4.3, 9.8],
    }


def _doc(independent_ms: float) -> dict:
    cfg = BenchConfig(strategies=("single", "threads", "dp", "ddp", "torch-ddp"), nproc=2)
    return report.build(cfg, _raw(independent_ms), GRAD_BYTES, 1_000_000)


def test_today_a_loaded_run_has_negative_communication_times():
    """What the measurements say before the report clamps them: the case being handled."""
    raw = _raw(230.0)
    med = {n: sorted(t)[2] for n, t in raw["main"]["times"].items()}
    assert med["ddp"] - med["independent"] == pytest.approx(-165.0)


def test_no_negative_figure_is_printed_and_confidence_is_low():
    doc = _doc(230.0)
    rows = {r["name"]: r for r in doc["strategies"]}
    for name in ("ddp", "torch-ddp"):
        assert rows[name]["comm_exposed_ms"] is None and rows[name]["comm_measurable"] is False
    table = report.format_table(doc)
    assert NEGATIVE.search(table) is None, NEGATIVE.search(table)
    ddp_line = next(line for line in table.splitlines() if line.startswith("ddp "))
    assert " n/m " in ddp_line
    assert "comm ms not measurable under this load for ddp, torch-ddp" in table
    rec = doc["recommendation"]
    assert rec["confidence"] == "low"
    assert "communication not measurable under this load" in rec["text"]
    assert "Confidence: low, the communication time of ddp, torch-ddp was not measurable" in (
        rec["text"]
    )
    assert "ms/step exposed in communication" not in rec["text"]


def test_a_quiet_run_keeps_its_numbers_and_normal_confidence():
    doc = _doc(45.0)  # independent 45 ms: ddp loses 20 ms, torch-ddp 35 ms to communication
    rows = {r["name"]: r for r in doc["strategies"]}
    assert rows["ddp"]["comm_exposed_ms"] == pytest.approx(20.0)
    assert rows["ddp"]["comm_measurable"] is True
    assert doc["recommendation"]["confidence"] == "normal"
    assert "Confidence" not in doc["recommendation"]["text"]
    assert "ddp 0.92x (efficiency 0.46, 20.0 ms/step exposed in communication)" in (
        doc["recommendation"]["text"]
    )
    assert "n/m" not in report.format_table(doc)


def test_the_model_check_says_low_or_high_instead_of_a_sign():
    table = report.format_table(_doc(45.0))
    check = next(line for line in table.splitlines() if "model check here" in line)
    assert re.search(r"measured 65\.0 ms \(\d+% (low|high)|within 1%\)", check), check
    assert NEGATIVE.search(check) is None


# -- the picture -------------------------------------------------------------------------


def _drawn(doc: dict):
    pytest.importorskip("matplotlib")
    from rankwise.bench import plot

    fig = plot.draw(doc)
    fig.canvas.draw()
    return fig, fig.canvas.get_renderer()


def test_the_picture_draws_nothing_negative():
    fig, _ = _drawn(_doc(230.0))
    for ax in fig.axes:
        words = [t.get_text() for t in ax.texts] + [t.get_text() for t in ax.get_yticklabels()]
        assert not any(NEGATIVE.search(w) for w in words), words
        assert ax.get_ylim()[0] >= 0
        for line in ax.lines:
            assert min(line.get_ydata(), default=0) >= 0


def test_a_modelled_point_off_the_curve_is_labelled_beside_it():
    doc = _doc(45.0)
    (first, second) = doc["projection"]["validation"]["rows"]
    # the model with the compute measured at 2 ranks vs with one process alone: not the same
    assert abs(first["modelled_efficiency"] - first["curve_efficiency"]) >= 0.01
    fig, renderer = _drawn(doc)
    from matplotlib.text import Text

    right = fig.axes[1]
    (label,) = [t for t in right.texts if t.get_text().startswith("hollow vs curve")]
    text = label.get_text()
    assert f"2 ranks: {first['modelled_efficiency']:.2f} vs {first['curve_efficiency']:.2f}" in text
    assert f"3 ranks: {second['modelled_efficiency']:.2f} vs {second['curve_efficiency']:.2f}" in text
    assert "compute: 45, 68 ms here" in text  # the independent steps measured at 2 and 3 ranks
    assert "30 ms for one process alone" in text  # c*B = 60 ms / 64 samples * 32
    assert label.get_fontsize() >= 9  # readable, not the 7.5-pt caption
    # tied to its point by a line, near it, inside the axes, covering no data
    assert label.xy == (2, first["modelled_efficiency"]) and label.arrow_patch is not None
    box = Text.get_window_extent(label, renderer)
    frame = right.get_window_extent(renderer)
    assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
    x, y = right.transData.transform(label.xy)
    gap = max(box.x0 - x, x - box.x1, 0) + max(box.y0 - y, y - box.y1, 0)
    assert gap < 250, f"the label is {gap:.0f} px from its point"
    drawn = [right.transData.transform(xy) for line in right.lines
             for xy in zip(line.get_xdata(), line.get_ydata(), strict=True)]
    drawn += [right.transData.transform(xy) for c in right.collections for xy in c.get_offsets()]
    assert not [p for p in drawn if box.contains(*p)], "the label hides a data point"
    # and a dotted segment joins the point to the curve at that world size
    segments = [ln for ln in right.lines if ln.get_linestyle() == ":"]
    ends = {(float(ln.get_xdata()[0]), tuple(round(v, 3) for v in ln.get_ydata()))
            for ln in segments}
    assert (2.0, (first["modelled_efficiency"], first["curve_efficiency"])) in ends


def test_no_label_when_the_point_sits_on_the_curve():
    doc = _doc(45.0)
    for row in doc["projection"]["validation"]["rows"]:
        row["curve_efficiency"] = row["modelled_efficiency"]
    fig, _ = _drawn(doc)
    assert not [t for t in fig.axes[1].texts if t.get_text().startswith("hollow vs curve")]
