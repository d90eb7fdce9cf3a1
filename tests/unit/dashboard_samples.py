"""Synthetic run directories for the dashboard tests: the records a job writes, made by hand.

A job of ``world`` ranks on two nodes steps every ``step_ms``; from ``slow_from`` on, rank
``slow_rank`` spends ``extra_ms`` more in backward and every other rank waits that long for
it in its all-reduce, so the straggler is named in the records from ``slow_from + 5``.
Everything here is the test's own arithmetic: the expectations are written from these
parameters, never read back through the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

PHASE_MS = {"data": 2.0, "forward": 10.0, "backward": 20.0, "comm": 5.0, "optimizer": 3.0,
            "checkpoint": 0.0, "other": 1.0}
BASE_MS = sum(PHASE_MS.values())  # 41 ms of work per rank and step
T0 = 1_700_000_000.0


def rank_record(rank: int, world: int, slow: bool, waiting: bool, extra_ms: float,
                mem: int | None) -> dict:
    ms = dict(PHASE_MS)
    if slow:
        ms["backward"] += extra_ms
    ms["wait"] = extra_ms if waiting else 0.0
    rec = {k: v / 1000 for k, v in ms.items()}
    rec.update(rank=rank, node=rank * 2 // world, wait_for=None, mem=mem,
               total=sum(ms.values()) / 1000)
    return rec


def write_run(run_dir: Path, *, world: int = 4, steps: int = 60, slow_rank: int = 2,
              slow_from: int = 30, extra_ms: float = 30.0, every: int = 1,
              hang: str | None = None, mem_base: int = 100 << 20) -> Path:
    """Write steps.jsonl and events.jsonl for a synthetic job; returns ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    t = T0
    lines, events = [], []
    for s in range(1, steps + 1):
        slow = s >= slow_from
        t += (BASE_MS + (extra_ms if slow else 0.0)) / 1000
        if s % every:
            continue
        ranks = []
        for r in range(world):
            rec = rank_record(r, world, slow and r == slow_rank, slow and r != slow_rank,
                              extra_ms, mem_base + r * (1 << 20) + s * (64 << 10))
            if slow and r != slow_rank:
                rec["wait_for"] = slow_rank
            ranks.append(rec)
        named = s >= slow_from + 5
        straggler = {"rank": slow_rank, "node": slow_rank * 2 // world, "kind": "compute",
                     "cost_ms": extra_ms, "since_step": slow_from, "chronic": s >= slow_from + 20}
        lines.append({"step": s, "t": t, "world": world, "strategy": "ddp", "ranks": ranks,
                      "straggler": straggler if named else None})
        if s == slow_from + 5:
            events.append({"t": t, "step": s, "event": "straggler",
                           "text": f"rank {slow_rank} is a compute straggler"})
    if hang:
        events.append({"t": t + 60, "step": steps, "event": "hang", "text": hang})
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in events))
    return run_dir
