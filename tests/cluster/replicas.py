"""A host lost, and returning, under in-memory replicas: ``--nnodes 1:3`` over c10d, 3 nodes x 1
worker running tests/e2e/scripts/replicas_train.py. Shared by tests/e2e/test_cluster_replicas.py
(which asserts) and benchmarks/recovery.py (which reports the times).

Every node's replica folder is ``<folder>/shm/cluster-job/node<i>`` (the nodes share one
``/dev/shm``; each has its own folder, and a node's workers read only theirs). A killed node's
folder is deleted with it: its RAM is gone.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

from . import jobs
from .faults import wait_until
from .netns import Cluster

SCRIPT = Path(__file__).resolve().parents[1] / "e2e" / "scripts" / "replicas_train.py"


def progress(out: Path) -> list[dict]:
    """Rank 0's ``{"step", "world", "time"}`` lines so far."""
    path = out / "progress.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return rows


def _launch(cluster: Cluster, node: int, folder: Path, args: list[str], name: str,
            nproc: int = 1):  # fmt: skip
    flags = jobs.run_flags(cluster, node, nproc=nproc, nnodes="1:3", rdzv="c10d", port=29400)
    # LOGLEVEL=INFO: torch's agent says "Starting worker group" (the rendezvous' end: Timeline)
    env = {"RANKWISE_REPLICA_HOST": f"node{node}", "RANKWISE_REPLICA_DIR": str(folder / "shm"),
           "RANKWISE_RDZV_LAST_CALL_S": "1", "LOGLEVEL": "INFO"}  # fmt: skip
    # docs/elastic.md's settings: a lost node is dropped from the rendezvous after 2 s of silence.
    conf = ["--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=4"]
    return jobs.start(cluster, node, [*flags, *conf, "--max-restarts", "3", str(SCRIPT), *args],
                      folder, env=env, name=name)  # fmt: skip


PHASES = {
    "failure_reported": "failed: exit code",  # the launcher saw a worker fail (after its diagnosis)
    "rendezvous_done": "Starting worker group",  # torch's agent: the new round is complete
    "workers_prepared": "rankwise prepare",  # a restarted worker reached rt.prepare
}
"""What ``Timeline`` watches for in the launchers' stderr: the first line after the kill."""


class Timeline(threading.Thread):
    """When each of ``PHASES`` first appears in any launcher's stderr after ``since`` (polled
    every 50 ms: the phases' seconds are good to about 0.1 s)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(daemon=True)
        self.folder, self.since, self.seen = folder, None, {}
        self.done, self._read = threading.Event(), {}

    def run(self) -> None:
        while not self.done.wait(0.05):
            for path in self.folder.glob("node*.err"):
                lines = path.read_text(errors="replace").splitlines()
                new, self._read[path] = lines[self._read.get(path, 0) :], len(lines)
                if self.since is None:
                    continue
                for name, marker in PHASES.items():
                    if name not in self.seen and any(marker in line for line in new):
                        self.seen[name] = time.time()

    def phases(self, first_step: float | None) -> dict[str, float]:
        """Seconds from the kill to each phase, and to the first step at the smaller world."""
        marks = {**self.seen, **({"trained": first_step} if first_step else {})}
        return {k: round(v - self.since, 2) for k, v in marks.items() if self.since is not None}


def _first(rows: list[dict], world: int, after: float) -> dict | None:
    return next((r for r in rows if r["world"] == world and r["time"] > after), None)


def host_lost(folder: Path, *, total: int = 100000, every: int = 1, sleep: float = 0.1,
              grow: bool = True, victim: int = 2, after: int = 5, strategy: str = "ddp",
              per_host: int = 1, global_batch: int = 12) -> dict:  # fmt: skip
    """Kill node ``victim`` after 8 steps; the survivors continue at world 2; with ``grow``, a
    replacement joins once they train again and the job returns to 3. Returns the facts and
    the times: ``kill_to_training_s`` (the kill to the first step finished at world 2),
    ``steps_lost`` (steps done at world 3 past the step resumed from), ``grow_back_s`` (the
    replacement's start to the first step finished at world 3 again). The job is stopped
    (a stop file) ``after`` steps past the last resize."""
    out = folder / "out"
    out.mkdir(parents=True)
    args = [str(out), "--steps", str(total), "--every", str(every), "--sleep", str(sleep),
            "--stop-file", str(folder / "stop"), "--strategy", strategy,
            "--global-batch", str(global_batch)]  # fmt: skip
    small, full = 2 * per_host, 3 * per_host  # the worlds after the loss and at full size
    timeline = Timeline(folder)
    timeline.start()
    with Cluster(3) as cluster:
        launchers = [_launch(cluster, n, folder, args, f"node{n}", per_host)
                     for n in (2, 1, 0)][::-1]  # fmt: skip
        started = wait_until(lambda: len(progress(out)) >= 8, 300)
        time.sleep(0.1)  # the timeline has read every line written before the kill
        cluster.kill(victim)
        killed = timeline.since = time.time()
        shutil.rmtree(folder / "shm" / "cluster-job" / f"node{victim}", ignore_errors=True)
        shrunk = wait_until(lambda: _first(progress(out), small, killed) is not None, 120)
        first2 = _first(progress(out), small, killed)
        timeline.done.set()
        joined, back = None, None
        if grow and shrunk is not None:
            joined = time.time()
            launchers[victim] = _launch(cluster, victim, folder, args, f"node{victim}-back",
                                        per_host)  # fmt: skip
            back = wait_until(lambda: _first(progress(out), full, joined) is not None, 120)
        n = len(progress(out))
        wait_until(lambda: len(progress(out)) >= n + after, 120)
        (folder / "stop").touch()
        survivors = [launcher for i, launcher in enumerate(launchers) if grow or i != victim]
        codes = jobs.finish(survivors, 300)
        text = "\n".join(launcher.stdout + launcher.stderr for launcher in survivors)
    facts = _facts(progress(out), killed, joined, started, shrunk, back, codes, text, small, full)
    return {**facts, "phases_s": timeline.phases(first2["time"] if first2 else None)}


def _facts(rows, killed, joined, started, shrunk, back, codes, text, small=2, full=3) -> dict:
    before = [r["step"] for r in rows if r["time"] <= killed]
    first2 = _first(rows, small, killed)
    first3 = _first(rows, full, joined) if joined is not None else None
    return {
        "hung": started is None or shrunk is None or None in codes,
        "codes": codes,
        "worlds": [r["world"] for r in rows],
        "steps": [r["step"] for r in rows],
        "last_step": rows[-1]["step"] if rows else None,
        "kill_to_training_s": None if first2 is None else round(first2["time"] - killed, 2),
        "steps_lost": None if first2 is None or not before else max(before) - (first2["step"] - 1),
        "grow_back_s": None if first3 is None else round(first3["time"] - joined, 2),
        "shrink_lines": [line for line in text.splitlines() if "continuing from step" in line],
        "cause_lines": [
            line
            for line in text.splitlines()
            if "stopped responding" in line or "restarting all workers" in line
        ],
        "text": text[-4000:],
    }
