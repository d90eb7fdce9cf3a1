"""Where CI's time goes: reads the output of pytest runs made with ``--durations=0`` and prints
JSON (per pass: the wall time pytest reported, the tests' summed durations, the costliest tests).
With ``--durations-min=S`` pytest lists only phases of at least S seconds: the sum is theirs.

    python -m pytest -m fast --durations=0 > fast.txt
    python benchmarks/ci_time.py --pass fast=fast.txt --conditions "quiet, 2 cores" \\
        --out benchmarks/results/ci_time.json

``--compare NAME=OLD.txt:NEW.txt`` compares the same tests in two outputs (the ratio of their
summed durations over the tests both ran), for a change measured twice in the same conditions.
A line ``W s wall U user S sys`` in an output (GNU time's ``-f "%e s wall %U user %S sys"``
around pytest) adds the run's CPU seconds, children included: under load, wall time says
little and CPU time still compares. The machine's load average at writing is recorded too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

PHASE = re.compile(r"^\s*(?P<s>\d+(?:\.\d+)?)s (?P<phase>setup|call|teardown)\s+(?P<id>\S+)")
SUMMARY = re.compile(r"^=* ?(\d+ \w+.*|no tests ran) in (?P<s>\d+(?:\.\d+)?)s\b")
TIME = re.compile(r"(?P<wall>\d+(?:\.\d+)?) s wall (?P<user>\d+(?:\.\d+)?) user (?P<sys>\d+(?:\.\d+)?) sys")
COUNT = re.compile(r"(?P<n>\d+) (?P<what>passed|failed|skipped|error|errors|deselected)\b")


def per_test(text: str) -> dict[str, float]:
    """Test id -> seconds (setup + call + teardown) from a ``--durations=0`` listing."""
    seconds: dict[str, float] = {}
    for line in text.splitlines():
        m = PHASE.match(line)
        if m:
            seconds[m["id"]] = seconds.get(m["id"], 0.0) + float(m["s"])
    return seconds


def per_file(tests: dict[str, float]) -> dict[str, float]:
    """Test file -> its tests' summed seconds, longest first (tests/xdist_order.py reads them)."""
    files: dict[str, float] = {}
    for test, seconds in tests.items():
        file = test.split("::", 1)[0]
        files[file] = files.get(file, 0.0) + seconds
    return {f: round(s, 1) for f, s in sorted(files.items(), key=lambda kv: -kv[1])}


def summary(text: str) -> dict:
    """The run's wall time and counts, from pytest's last line."""
    lines = [ln for ln in text.splitlines() if SUMMARY.match(ln.strip())]
    if not lines:
        return {"wall_s": None}
    counts = {m["what"]: int(m["n"]) for m in COUNT.finditer(lines[-1])}
    out = {"wall_s": float(SUMMARY.match(lines[-1].strip())["s"]), **counts}
    timed = TIME.search(text)
    if timed:
        out["cpu_s"] = round(float(timed["user"]) + float(timed["sys"]), 1)
    return out


def describe(path: Path, top: int) -> dict:
    text = path.read_text(errors="replace")
    tests = per_test(text)
    costliest = sorted(tests.items(), key=lambda kv: -kv[1])[:top]
    return {
        **summary(text),
        "tests_timed": len(tests),
        "tests_sum_s": round(sum(tests.values()), 1),
        "files_s": per_file(tests),
        "costliest": [{"test": t, "s": round(s, 2)} for t, s in costliest],
    }


def cpu_log(path: Path, top: int) -> dict:
    """A ``benchmarks/_ci_durlog.py`` log: per test, wall (its phases) and CPU seconds."""
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    loads = []
    for line in path.read_text().splitlines():
        w, c, phase, _, test, _, load = line.split("\t")
        wall[test] = wall.get(test, 0.0) + float(w)
        if phase == "teardown":
            cpu[test] = float(c)
            loads.append(float(load))
    rows = sorted(cpu, key=lambda t: -cpu[t])[:top]
    return {"tests": len(cpu), "wall_s": round(sum(wall[t] for t in cpu), 1),
            "cpu_s": round(sum(cpu.values()), 1),
            "load_1min": [min(loads), max(loads)] if loads else None,
            "costliest_cpu": [{"test": t, "cpu_s": cpu[t], "wall_s": round(wall[t], 1)}
                              for t in rows]}  # fmt: skip


def compare(before: Path, after: Path) -> dict:
    texts = before.read_text(errors="replace"), after.read_text(errors="replace")
    old, new = per_test(texts[0]), per_test(texts[1])
    both = sorted(set(old) & set(new))
    a, b = sum(old[t] for t in both), sum(new[t] for t in both)
    out = {"tests_listed_in_both": len(both), "before_s": round(a, 1), "after_s": round(b, 1),
           "ratio_after_over_before": round(b / a, 3) if a else None}  # fmt: skip
    runs = [summary(t) for t in texts]
    out.update(before_run_wall_s=runs[0]["wall_s"], after_run_wall_s=runs[1]["wall_s"])
    cpu = [run.get("cpu_s") for run in runs]
    if None not in cpu:
        out.update(before_cpu_s=cpu[0], after_cpu_s=cpu[1], cpu_ratio=round(cpu[1] / cpu[0], 3))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pass", dest="passes", action="append", default=[], metavar="NAME=FILE",
                   help="a pytest output with --durations=0; repeat per pass of .ci/run")
    p.add_argument("--compare", action="append", default=[], metavar="NAME=BEFORE:AFTER",
                   help="two --durations=0 outputs of the same tests, before and after a change")
    p.add_argument("--cpu-log", type=Path, help="a benchmarks/_ci_durlog.py log")
    p.add_argument("--conditions", default="", help="the machine and its load, in words")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--out", type=Path, help="write the JSON here too")
    args = p.parse_args(argv)
    result: dict = {"conditions": args.conditions, "cores": os.cpu_count(),
                    "loadavg_at_write": [round(x, 2) for x in os.getloadavg()], "passes": {}}
    for spec in args.passes:
        name, _, file = spec.partition("=")
        result["passes"][name] = describe(Path(file), args.top)
    walls = [v["wall_s"] for v in result["passes"].values()]
    if walls and None not in walls:
        result["total_wall_s"] = round(sum(walls), 1)
    if args.cpu_log:
        result["cpu_log"] = cpu_log(args.cpu_log, args.top)
    for spec in args.compare:
        name, _, files = spec.partition("=")
        before, _, after = files.partition(":")
        result.setdefault("same_tests_before_after", {})[name] = compare(Path(before), Path(after))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
