"""The schedules' figures of ``benchmarks/pipeline.py`` as a Markdown table: one row per
(stages, micro-batches, schedule), ours beside torch's schedule of the same name."""

from __future__ import annotations


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _peaks(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def _ceiling(r: dict) -> str:
    """The row's noise and ceiling columns (empty in files from before they were measured)."""
    if "ceiling_ms" not in r:
        return "| | | | "
    spread, paired = r["ratio_per_repeat"], r.get("ratio_paired")
    interval = ("" if paired is None or paired["low"] is None else
                f" (99%: {paired['low']:.2f}-{paired['high']:.2f}, {paired['verdict']})")  # fmt: skip
    return (f"| {spread['min']:.2f}-{spread['max']:.2f}{interval} | {r['ceiling_ms']:.0f} "
            f"| {r['rankwise_over_ceiling']:.2f} | {r['torch_over_ceiling']:.2f} ")  # fmt: skip


def table(section: dict) -> str:
    """``section``: ``report["schedules"]`` (or ``["simulated"]``). Step time: the slowest
    stage's median step; per repeat: the range of ours/torch's repeat by repeat, and (in files
    that have it) the 99% interval of their geometric mean with its verdict (``_paired``:
    slower, faster, or even when the interval holds 1); ceiling: our
    schedule played with each of our actions' measured time and free communication (torch's
    step is set against the same one); bubble: the mean over the stages of each one's idle
    share; activation peak: per stage, MiB (stage 0 first)."""
    lines = [
        "| stages | m | schedule (torch's) | step ms ours | step ms torch | ours/torch "
        "| per repeat | ceiling ms | ours/ceiling | torch/ceiling "
        "| bubble ours | bubble torch | activation peak MiB per stage, ours | torch's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p, rows in section["rows"].items():
        for r in rows:
            ours, theirs = r["rankwise"], r["torch"]
            name = r["schedule"] + (f" v={r['stages_per_rank']}" if r["stages_per_rank"] > 1 else "")
            lines.append(
                f"| {p} | {r['m']} | {name} ({r['torch_schedule']}) | {ours['step_ms']:.0f} "
                f"| {theirs['step_ms']:.0f} | {r['step_ours_over_torch']:.2f} {_ceiling(r)}"
                f"| {_mean(ours['bubble_per_stage']):.2f} | {_mean(theirs['bubble_per_stage']):.2f} "
                f"| {_peaks(ours['activation_peak_mb_per_stage'])} "
                f"| {_peaks(theirs['activation_peak_mb_per_stage'])} |"
            )
    return "\n".join(lines)


def targets_lines(section: dict) -> str:
    """The issue's targets as a list: each one's name and whether it held (n/a: not run)."""
    shown = {True: "holds", False: "does not hold", None: "n/a"}
    return "\n".join(f"- `{k}`: {shown[v]}" for k, v in section["targets"].items())
