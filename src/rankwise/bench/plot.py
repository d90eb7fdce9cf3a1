"""The report as a PNG: throughput per strategy, and scaling efficiency projected to 256 ranks.

matplotlib with the Agg backend (no display needed); imported only when a plot is written.
"""

from __future__ import annotations

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
    _projection(right, doc)
    fig.suptitle(f"rankwise bench: {doc['config']['model']}, {doc['config']['nproc']} workers")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
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


def _projection(ax, doc: dict) -> None:
    p = doc["projection"]
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


NOTE = (
    "curve: the ring model, with the compute term = the one-process step measured here. "
    "Filled: the efficiency measured here at that\nworld size; hollow: the model's value for "
    "the same run (their gap is the model's error here, not a second measurement)."
)
