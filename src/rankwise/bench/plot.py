"""The report as a PNG: throughput per strategy, and scaling efficiency projected to 256 ranks.

matplotlib with the Agg backend (no display needed); imported only when a plot is written.
"""

from __future__ import annotations

import itertools
from pathlib import Path


def write_png(doc: dict, path: Path) -> Path:
    """Draw ``doc`` (a ``report.build`` document) to ``path``; returns the path."""
    import matplotlib.pyplot as plt

    fig = draw(doc)
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)
    return path


def draw(doc: dict):
    """The figure (two panels); the legend and the notes sit below the axes, off the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.3))
    _throughput(left, doc)
    label = _projection(right, doc)
    fig.suptitle(f"rankwise bench: {doc['config']['model']}, {doc['config']['nproc']} workers")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    if label is not None:  # placed once the layout is final: positions are in pixels
        _place(label, right, fig.canvas.get_renderer())
    return fig


def _throughput(ax, doc: dict) -> None:
    rows = [r for r in doc["strategies"] if r["available"]]
    names = [r["name"] for r in rows]
    gb = doc["config"]["global_batch"] * 1e3
    med = [r["samples_per_s"] for r in rows]
    # Error bars span the repeats: samples/s at the slowest and fastest repeat.
    # (Clamped at 0: samples/s is rounded, so with one repeat a bar could be "below" itself.)
    low = [max(0.0, m - gb / r["step_ms"]["max"]) for m, r in zip(med, rows, strict=True)]
    high = [max(0.0, gb / r["step_ms"]["min"] - m) for m, r in zip(med, rows, strict=True)]
    colors = ["tab:gray" if not r["exact"] else "tab:blue" for r in rows]
    best = doc["recommendation"]["strategy"]
    colors = ["tab:green" if n == best else c for n, c in zip(names, colors, strict=True)]
    ax.bar(names, med, yerr=[low, high], color=colors, capsize=3)
    for i, r in enumerate(rows):
        # Above the error bar's cap, not on the bar's top where the bar would cross it.
        ax.annotate(f"{r['speedup']:.2f}x", (i, med[i] + high[i]), xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max((m + h for m, h in zip(med, high, strict=True)), default=1) * 1.15 or 1)
    ax.set_ylabel("samples/s (median, min-max over repeats)")
    ax.set_title("measured here (green: recommended, grey: not exact)")
    ax.tick_params(axis="x", rotation=30)


def _projection(ax, doc: dict):
    """The efficiency panel; returns the label of the modelled points off the curve (or None)."""
    p = doc["projection"]
    label = None
    worlds = [r["world"] for r in p["curve"]]
    ax.plot(
        worlds, [r["efficiency"] for r in p["curve"]], marker="o", label="projected (ring model)"
    )
    checks = [c for c in p["validation"]["rows"] if "efficiency" in c]
    if checks:
        # One definition everywhere (the table's): efficiency = c*B / step = speedup / ranks,
        # with c*B one process's time for one rank's batch.
        worlds_here = [c["world"] for c in checks]
        ax.scatter(
            worlds_here,
            [c["efficiency"] for c in checks],
            color="tab:red",
            zorder=3,
            label="here, measured (ddp)",
        )
        ax.scatter(
            worlds_here,
            [c["modelled_efficiency"] for c in checks],
            facecolors="none",
            edgecolors="tab:red",
            s=80,
            zorder=3,
            label="here, modelled",
        )
        label = _label_gaps(ax, checks, p)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("ranks")
    ax.set_ylabel("scaling efficiency = speedup / ranks\n(one-process step / (ranks x step))")
    ax.set_title(f"synchronous data parallel, {p['network']['source']} network")
    # Below the axes: on CPU the measured points sit at 0.03-0.2, where a legend inside would be.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8, frameon=False)
    ax.text(0.5, -0.27, NOTE, transform=ax.transAxes, ha="center", va="top", fontsize=7.5,
            wrap=True)
    ax.grid(alpha=0.3)
    return label


def _label_gaps(ax, checks: list[dict], p: dict) -> None:
    """Where a hollow point is off the curve: a dotted segment from one to the other, and a
    label beside the first such point giving both values and why they differ.

    Both are the ring model with two compute terms: the curve takes one process's step alone
    (``c*B``), a point the ``independent`` step measured at that world size (ranks sharing this
    machine's cores run slower); the curve may also use a ``--network`` given.
    """
    gaps = [c for c in checks if c.get("curve_efficiency") is not None
            and abs(c["curve_efficiency"] - c["modelled_efficiency"]) >= 0.01]
    if not gaps:
        return
    for c in gaps:
        ax.plot([c["world"]] * 2, [c["modelled_efficiency"], c["curve_efficiency"]],
                linestyle=":", color="tab:red", linewidth=1.2)
    alone = p["compute_ms_per_sample"] * p["per_rank_batch"]
    rows = "\n".join(f"{c['world']} ranks: {c['modelled_efficiency']:.2f} vs "
                     f"{c['curve_efficiency']:.2f}" for c in gaps)
    here = ", ".join(f"{c['independent_ms']:.0f}" for c in gaps)
    text = (f"hollow vs curve (dotted)\n{rows}\ncompute: {here} ms here,\n"
            f"{alone:.0f} ms for one process alone")
    if p["network"].get("source") == "given":
        text += "\ncurve: the --network given"
    first = gaps[0]
    return ax.annotate(
        text, (first["world"], first["modelled_efficiency"]), xytext=(12, 10),
        textcoords="offset points", ha="left", va="bottom", fontsize=9, color="tab:red",
        bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none", "pad": 1},
        arrowprops={"arrowstyle": "-", "color": "tab:red", "linewidth": 0.8},
    )


_OFFSETS = sorted(
    ((dx, dy, "bottom" if dy > 0 else "top") for dx in (12, 40, 70, 100, 140)
     for dy in (8, -8, 30, -30, 55, -55, 80, -80)),
    key=lambda o: o[0] ** 2 + o[1] ** 2,
)
"""Where the label may sit, in points from its point (x right, y up, vertical alignment),
nearest first."""


def _place(label, ax, renderer) -> None:
    """Move ``label`` to the first offset where it stays inside the axes and covers no data
    (curve, markers, dotted segments); failing that, where it covers the least."""
    import numpy as np
    from matplotlib.text import Text

    line_points, markers = [], []
    for line in ax.lines:  # the curve and the dotted segments, sampled every few pixels
        xy = ax.transData.transform(np.column_stack([line.get_xdata(), line.get_ydata()]))
        for a, b in itertools.pairwise(xy):
            line_points += [a + (b - a) * t for t in np.linspace(0, 1, 40)]
    for points in ax.collections:  # the measured and modelled markers
        markers += list(ax.transData.transform(points.get_offsets()))
    frame = ax.get_window_extent(renderer)
    best = None
    for dx, dy, va in _OFFSETS:
        label.set_position((dx, dy))
        label.set_va(va)
        label.update_positions(renderer)
        # the text alone (an annotation's extent includes its line to the point)
        box = Text.get_window_extent(label, renderer).expanded(1.04, 1.1)
        inside = box.x0 >= frame.x0 and box.x1 <= frame.x1 and box.y0 >= frame.y0 and box.y1 <= frame.y1
        score = (not inside, _covered(box, markers, 8), _covered(box, line_points, 2))
        if best is None or score < best[0]:
            best = (score, dx, dy, va)
        if score == (False, 0, 0):
            break
    _, dx, dy, va = best
    label.set_position((dx, dy))
    label.set_va(va)


def _covered(box, points: list, margin: float) -> int:
    """How many of ``points`` (pixels) lie in ``box`` grown by ``margin`` pixels."""
    return sum(box.x0 - margin <= x <= box.x1 + margin and box.y0 - margin <= y <= box.y1 + margin
               for x, y in points)


NOTE = (
    "curve: the ring model, with the compute term = the one-process step measured here. "
    "Filled: the efficiency measured here at that\nworld size; hollow: the model's value for "
    "the same run (their gap is the model's error here, not a second measurement)."
)
