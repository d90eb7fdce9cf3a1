"""The web page's pictures: matplotlib figures rendered to inline SVG (no script, no CDN).

Figures are built with matplotlib's object API (``Figure``, no pyplot), so the server's
threads share no global figure state; text stays text in the SVG (``svg.fonttype: none``).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from . import series
from .records import PHASES, Step
from .summary import RankSummary, Summary

COLOR = {
    "data": "tab:cyan", "forward": "tab:green", "backward": "tab:blue", "comm": "tab:purple",
    "wait": "tab:red", "optimizer": "tab:olive", "checkpoint": "tab:gray", "other": "lightgray",
}
MAX_SERIES = 8
"""Ranks drawn one by one over time; a larger job shows the straggler and the busiest."""


def _svg(fig) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "rankwise"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]  # inline: no XML declaration or doctype


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100)


def ranks_shown(summary: Summary, n: int = MAX_SERIES) -> list[int]:
    """The straggler, then the ranks that work longest (their step minus their wait)."""
    order = sorted(summary.ranks, key=lambda r: r.phases["wait"] - r.total)
    ranks = [r.rank for r in order]
    if summary.straggler and summary.straggler.rank in ranks:
        ranks.remove(summary.straggler.rank)
        ranks.insert(0, summary.straggler.rank)
    return sorted(ranks[:n])


def anatomy_bars(ranks: Sequence[RankSummary], straggler: int | None) -> str:
    """Mean milliseconds per phase, one stacked bar per rank."""
    fig = _figure(7.5, 0.9 + 0.32 * max(len(ranks), 1))
    ax = fig.add_subplot()
    left = [0.0] * len(ranks)
    ys = list(range(len(ranks)))
    for p in PHASES:
        widths = [r.phases[p] * 1000 for r in ranks]
        ax.barh(ys, widths, left=left, color=COLOR[p], label=p, height=0.7)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_yticks(ys, [f"rank {r.rank}" + (" \u25c0" if r.rank == straggler else "")
                       for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (mean over the last records)")
    ax.legend(ncol=4, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    return _svg(fig)


def anatomy_over_time(steps: Sequence[Step], ranks: Sequence[int]) -> str:
    """One panel per rank: its phases stacked, in ms, over the run (binned: ``series``)."""
    fig = _figure(7.5, 0.6 + 1.1 * max(len(ranks), 1))
    axes = fig.subplots(max(len(ranks), 1), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    groups = series.bins(steps)
    for ax, rank in zip(axes, ranks, strict=False):
        curve = series.rank_curve(groups, rank)
        if curve.steps:
            ax.stackplot(curve.steps, *(curve.phases_ms[p] for p in PHASES),
                         colors=[COLOR[p] for p in PHASES], labels=list(PHASES))
        ax.set_ylabel(f"rank {rank}\nms", fontsize=8)
    if axes[0].collections:
        axes[0].legend(ncol=4, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0),
                       frameon=False)
    axes[-1].set_xlabel("step")
    return _svg(fig)


def memory(steps: Sequence[Step], ranks: Sequence[int]) -> str:
    """Each shown rank's peak memory (MiB) over the run."""
    fig = _figure(7.5, 2.6)
    ax = fig.add_subplot()
    groups = series.bins(steps)
    top = 0.0
    for rank in ranks:
        curve = series.rank_curve(groups, rank)
        pts = [(x, m) for x, m in zip(curve.steps, curve.mem_mib, strict=True) if m is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), label=f"rank {rank}")
            top = max(top, *(m for _, m in pts))
    if ax.lines:
        ax.set_ylim(0, top * 1.15 or 1)  # from zero: a flat line stays flat, a leak climbs
        ax.legend(ncol=4, fontsize=8, frameon=False, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no memory recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    return _svg(fig)


def throughput(steps: Sequence[Step]) -> str:
    """Steps per second over the run, and the step time (the slowest rank's)."""
    fig = _figure(7.5, 2.6)
    ax = fig.add_subplot()
    groups = series.bins(steps)
    speed = series.throughput_curve(groups)
    if speed:
        ax.plot(*zip(*speed, strict=True), color="tab:blue", label="steps/s")
    ax.set_xlabel("step")
    ax.set_ylabel("steps/s", color="tab:blue")
    twin = ax.twinx()
    pts = series.step_time_curve(groups)
    if pts:
        twin.plot(*zip(*pts, strict=True), color="tab:orange", label="ms/step")
    twin.set_ylabel("ms per step", color="tab:orange")
    return _svg(fig)
