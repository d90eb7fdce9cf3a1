"""Restart from disk measured on the namespace cluster, phase by phase, for benchmarks/goodput.py.

3 hosts x 1 process, ``rankwise run --nnodes 2:3 --max-restarts 1`` over c10d, running
benchmarks/_goodput_train.py (a checkpoint every K steps). A killed trial SIGKILLs every process
of host 2 once rank 0 has logged step ``kill_at`` and starts a replacement there at once; an
unkilled trial is the same job left alone. Each trial returns its timeline, read from the files
the script writes (phases, steps, saves) and the moment of the kill.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cluster import jobs
from cluster.netns import Cluster

SCRIPT = Path(__file__).resolve().parent / "_goodput_train.py"
NODES = 3


def _lines(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [ln.split() for ln in path.read_text().splitlines() if len(ln.split()) >= 2]


def _steps(folder: Path) -> list[tuple[int, float]]:
    return [(int(s[0]), float(s[1])) for s in _lines(folder / "steps")]


def _last_step(folder: Path) -> int:
    rows = _steps(folder)
    return rows[-1][0] if rows else 0


def _launch(cluster: Cluster, node: int, args: list[str], folder: Path, name: str):
    flags = jobs.run_flags(cluster, node, nproc=1, nnodes=f"{NODES - 1}:{NODES}", rdzv="c10d",
                           port=29400, timeout=120)  # fmt: skip
    return jobs.start(cluster, node, [*flags, "--max-restarts", "1", *args], folder, name=name)


def run(folder: Path, *, steps: int, save_every: int, sleep: float, kill_at: int | None) -> dict:
    """One trial; ``kill_at=None``: unkilled."""
    folder.mkdir(parents=True, exist_ok=True)
    args = [str(SCRIPT), str(folder), "--steps", str(steps), "--save-every", str(save_every),
            "--sleep", str(sleep)]  # fmt: skip
    kill_t = None
    with Cluster(NODES) as cluster:
        first = [_launch(cluster, n, args, folder, f"node{n}") for n in reversed(range(NODES))]
        launchers = first[::-1]
        if kill_at is not None:
            deadline = time.monotonic() + 300
            while _last_step(folder) < kill_at and time.monotonic() < deadline:
                time.sleep(0.01)
            kill_t = time.time()
            cluster.kill(NODES - 1)
            launchers[-1] = _launch(cluster, NODES - 1, args, folder, "replacement")
        codes = jobs.finish(launchers, 300)
    out = timeline(folder, kill_t)
    return {**out, "codes": codes, "kill_at": kill_at, "save_every": save_every,
            "steps": steps, "sleep": sleep}  # fmt: skip


def _phase(rows: list[list[str]], name: str, after: float) -> tuple[float, int] | None:
    for r in rows:
        if r[0] == name and float(r[2]) > after:
            return float(r[2]), int(r[3]) if len(r) > 3 else 0
    return None


def timeline(folder: Path, kill_t: float | None) -> dict:
    """What the files say: the step time, the save cost, the wall time of the training (first
    logged step to the last) and, for a killed trial, every phase of the recovery."""
    rows = _steps(folder)
    saves = [float(s[1]) for s in _lines(folder / "saves")]
    before = [(s, t) for s, t in rows if kill_t is None or t <= kill_t]
    gaps = [t1 - t0 for (s0, t0), (s1, t1) in itertools.pairwise(before) if s1 == s0 + 1]
    save_steps = {int(s[0]) for s in _lines(folder / "saves")}
    plain = [t1 - t0 for (s0, t0), (s1, t1) in itertools.pairwise(before)
             if s1 == s0 + 1 and s1 not in save_steps]  # fmt: skip
    out = {
        "step_s": round(statistics.median(plain or gaps or [0.0]), 4),
        "save_s": round(statistics.median(saves), 4) if saves else 0.0,
        "train_wall_s": round(rows[-1][1] - rows[0][1], 3) if rows else None,
        "first_step": rows[0][0] if rows else None,
        "last_step": rows[-1][0] if rows else None,
    }
    if kill_t is None:
        return out
    return {**out, **_recovery(folder, kill_t, before, rows)}


def _recovery(folder: Path, kill_t: float, before: list, rows: list) -> dict:
    phases = _lines(folder / "phases")
    start, imported = _phase(phases, "start", kill_t), _phase(phases, "imported", kill_t)
    joined, loaded = _phase(phases, "joined", kill_t), _phase(phases, "loaded", kill_t)
    if None in (start, imported, joined, loaded):
        return {"recovered": False}
    at_kill = before[-1][0] if before else 0
    after = [(s, t) for s, t in rows if t > loaded[0]]
    again = next((t for s, t in after if s >= at_kill), None)
    return {
        "recovered": True,
        "step_at_kill": at_kill,
        "resumed_step": loaded[1],
        "steps_lost": at_kill - loaded[1],
        "detect_restart_s": round(start[0] - kill_t, 3),
        "import_s": round(imported[0] - start[0], 3),
        "rendezvous_s": round(joined[0] - imported[0], 3),
        "load_s": round(loaded[0] - joined[0], 3),
        "first_step_s": round(after[0][1] - loaded[0], 3) if after else None,
        "kill_to_training_s": round(after[0][1] - kill_t, 3) if after else None,
        "recompute_s": round(again - loaded[0], 3) if again and at_kill > loaded[1] else 0.0,
        "kill_to_caught_up_s": round(again - kill_t, 3) if again else None,
    }
