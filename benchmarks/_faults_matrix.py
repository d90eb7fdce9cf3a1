"""``benchmarks/faults.py --matrix``: every cell of the fault matrix (tests/cluster/matrix.py).

Cells run ``--parallel`` at a time (each on its own cluster of network namespaces; root only),
in an order drawn with ``--seed`` so that a run cut short by ``--budget-s`` still samples every
fault and topology; the cells it could not reach are listed as not run, never counted as
passed. Cells a rule skips (a pipeline with one worker per host...) are counted with the rule.
Writes ``benchmarks/results/fault_matrix.json``: the counts (cells, run, passed, failed,
skipped by rule, not run), per cell its outcome and times, the worst and median of each time
against its promise (stop <= 10 s; stall report <= 60 s, end <= 10 s after it), and the
machine's load (os.getloadavg()) before, during and after, and per cell at its start and end.

``--resume`` keeps the cells the file already holds (a run cut short, or several short runs,
accumulate into one file; each cell records the commit it ran), ``--rerun-failed`` runs its
failed cells again (the new outcome replaces the old), ``--faults`` limits the run to some
faults. The file is rewritten after every cell, so a run killed at a deadline loses nothing.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cluster import matrix, netem_unavailable, unavailable

OUT = Path(__file__).resolve().parent / "results" / "fault_matrix.json"
STOPS = ("crash", "host_killed", "launcher_sigkill")  # stop_s: from the fault to all ended
COMPLETES = ("cut_healed", "slow_link", "reinit")  # stop_s: from the fault to the job's end


def _order(seed: int) -> list[matrix.Cell]:
    """Runnable cells, shuffled, then round-robin over faults (a short run samples them all)."""
    rng = random.Random(seed)
    runnable = [c for c in matrix.CELLS if matrix.rule(c) is None]
    rng.shuffle(runnable)
    by_fault = {f: [c for c in runnable if c.fault == f] for f in matrix.FAULTS}
    order = []
    while any(by_fault.values()):
        for cells in by_fault.values():
            if cells:
                order.append(cells.pop())
    return order


def budget(budget_s: float, until: str | None) -> float:
    """Seconds to go on starting cells: ``budget_s``, cut to the UTC time ``until`` (HH:MM)."""
    if until is None:
        return budget_s
    import datetime as dt

    now = dt.datetime.now(dt.timezone.utc)
    hour, minute = (int(x) for x in until.split(":"))
    end = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    return max(0.0, min(budget_s, (end - now).total_seconds()))


def _slow_link() -> dict:
    """How the slow link was shaped here: by rate alone where the kernel has no netem."""
    if netem_unavailable():
        return {"rate": "50mbit", "delay": None,
                "note": "this kernel has no netem: the link is shaped by rate alone, no delay"}
    return {"rate": "50mbit", "delay": "20ms", "note": "rate and netem delay"}


def _spread(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "min": round(min(values), 2),
            "median": round(statistics.median(values), 2), "max": round(max(values), 2)}  # fmt: skip


def _times(results: list[dict], key: str, promise: float | None) -> dict:
    values = [r[key] for r in results if r.get(key) is not None]
    if not values:
        return {"n": 0}
    over = None if promise is None else sum(v > promise for v in values)
    return {"n": len(values), "max": max(values), "median": round(statistics.median(values), 2),
            "promise": promise, "over_promise": over}  # fmt: skip


def _commit() -> str:
    """The commit the cells run (a snapshot without git names it in RANKWISE_MATRIX_COMMIT)."""
    import subprocess

    named = os.environ.get("RANKWISE_MATRIX_COMMIT")
    if named:
        return named
    root = Path(__file__).resolve().parents[1]
    found = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True, check=False)  # fmt: skip
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "src", "tests"],
                           capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    return (found.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def _kept(out: Path, resume: bool, rerun_failed: bool) -> list[dict]:
    """The cells ``out`` already holds that this run keeps (``--resume``)."""
    if not resume or not out.exists():
        return []
    old = json.loads(out.read_text()).get("cells", [])
    names = {c.name for c in matrix.CELLS if matrix.rule(c) is None}
    return [r for r in old if r.get("name") in names and not (rerun_failed and r["ok"] is False)]


def run(budget_s: float, parallel: int, seed: int, out: Path = OUT, *, resume: bool = False,
        rerun_failed: bool = False, faults: list[str] | None = None) -> dict:  # fmt: skip
    reason = unavailable()
    if reason is not None:
        print(f"fault matrix skipped: {reason}", file=sys.stderr)
        return {}
    start, loads, commit = time.monotonic(), [os.getloadavg()], _commit()
    results = _kept(out, resume, rerun_failed)
    done_names = {r["name"] for r in results}
    pending = [c for c in _order(seed) if c.name not in done_names
               and (not faults or c.fault in faults)]  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="rw-matrix-"))
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        running: dict = {}  # future -> cell
        while pending or running:
            while pending and len(running) < parallel and time.monotonic() - start < budget_s:
                cell = pending.pop(0)
                running[pool.submit(_one, cell, tmp / cell.name, commit)] = cell
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                del running[f]
                results.append(f.result())
                loads.append(os.getloadavg())
                r = results[-1]
                print(f"{r['name']}: {'ok' if r['ok'] else r.get('problems') or r.get('skipped')}",
                      file=sys.stderr, flush=True)  # fmt: skip
            _write(out, _report(results, loads, time.monotonic() - start, seed, parallel))
    report = _report(results, loads, time.monotonic() - start, seed, parallel)
    _write(out, report)
    return report


def _write(out: Path, report: dict) -> None:
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, out)


def _one(cell: matrix.Cell, folder: Path, commit: str) -> dict:
    stamp = {"commit": commit, "load_start": os.getloadavg()}
    try:
        r = matrix.run(cell, folder)
    except Exception as exc:  # a cell that breaks the harness counts as failed, with why
        r = {"cell": cell.__dict__, "name": cell.name, "ok": False,
             "problems": [f"harness: {type(exc).__name__}: {exc}"]}  # fmt: skip
    return {**r, **stamp, "load_end": os.getloadavg()}


def _report(results, loads, wall_s, seed, parallel) -> dict:
    ran = [r for r in results if r["ok"] is not None]
    have = {r["name"] for r in results}
    not_run = [c for c in matrix.CELLS if matrix.rule(c) is None and c.name not in have]
    per_cell = [x[0] for r in results for x in (r.get("load_start"), r.get("load_end")) if x]
    commits: dict[str, int] = {}
    for r in results:
        commits[r.get("commit", "unrecorded")] = commits.get(r.get("commit", "unrecorded"), 0) + 1
    skipped = [c for c in matrix.CELLS if matrix.rule(c) is not None]
    rules: dict[str, int] = {}
    for c in skipped:
        rules[matrix.rule(c)] = rules.get(matrix.rule(c), 0) + 1
    by_fault = {f: {"run": sum(r["cell"]["fault"] == f for r in ran),
                    "passed": sum(r["cell"]["fault"] == f and r["ok"] for r in ran)}
                for f in matrix.FAULTS}  # fmt: skip
    return {
        "what": "fault matrix: topology x bucket (both sides of 1 MiB) x strategy x fault",
        "counts": {"cells": len(matrix.CELLS), "run": len(ran),
                   "passed": sum(bool(r["ok"]) for r in ran),
                   "failed": sum(not r["ok"] for r in ran), "skipped_by_rule": len(skipped),
                   "skipped_on_this_machine": len(results) - len(ran),
                   "not_run": len(not_run)},
        "by_fault": by_fault,
        "times": {"stop_s": _times([r for r in ran if r["cell"]["fault"] in STOPS], "stop_s",
                                   matrix.STOP_S),
                  "complete_s": _times([r for r in ran if r["cell"]["fault"] in COMPLETES],
                                       "stop_s", None),
                  "report_s": _times(ran, "report_s", matrix.REPORT_S),
                  "end_after_report_s": _times(ran, "end_after_report_s", matrix.STOP_S),
                  "verdict_silence_s": _times(ran, "verdict_silence_s", None)},
        "settings": {"RANKWISE_STALL_REPORT_S": matrix.STALL_S, "timeout_s": matrix.TIMEOUT_S,
                     "parallel_cells": parallel, "seed": seed, "wall_s": round(wall_s, 1),
                     "widths": matrix.WIDTHS},
        "load": {"cores": os.cpu_count(), "loadavg_before": loads[0],
                 "loadavg_max_1min": max(x[0] for x in loads), "loadavg_after": loads[-1],
                 "per_cell_1min": _spread(per_cell),
                 "note": "a shared 2-core machine, other jobs running: times are upper bounds"},
        "commits": commits,
        "slow_link": _slow_link(),
        "rules": rules,
        "failed": [{"name": r["name"], "problems": r["problems"]} for r in ran if not r["ok"]],
        "cells": results,
        "not_run": [c.name for c in not_run],
    }
