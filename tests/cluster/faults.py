"""Faults between machines, one trial each: a node killed, the link cut (and healed), a node
replaced. Shared by tests/e2e/test_cluster_faults.py (which asserts) and
benchmarks/_faults_cluster.py (which counts trials and times).

Every trial runs tests/e2e/scripts/cluster_train.py under ``rankwise run`` on a fresh cluster
and returns a dict: ``seconds`` (the figure its row reports), ``hung`` (something did not end),
``lost`` (a checkpoint that returned is gone, or ``latest`` does not load), and its own facts.
"""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

from . import jobs
from .netns import Cluster

SCRIPT = Path(__file__).resolve().parents[1] / "e2e" / "scripts" / "cluster_train.py"
TRAIN_FLAGS = ["--steps", "100000", "--sleep", "0.05", "--save-every", "5"]


def wait_until(cond, timeout: float, poll: float = 0.05) -> float | None:
    """Seconds until ``cond()`` holds, or None after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if cond():
            return time.monotonic() - start
        time.sleep(poll)
    return None


def steps(folder: Path) -> int:
    path = folder / "steps"
    lines = path.read_text().split() if path.exists() else []
    return int(lines[-2]) if len(lines) >= 2 else 0


def checkpoint_ok(folder: Path, big: bool = False) -> bool:
    """``latest`` loads, every ``ckpt-*.pt`` loads, and none is older than the last save that
    returned (``saved``): a fault never loses a checkpoint."""
    import rankwise as rw

    train_model = _script().model_for
    saved = (folder / "saved").read_text().split() if (folder / "saved").exists() else []
    ckpt = folder / "ckpt"
    try:
        for path in ckpt.glob("ckpt-*.pt"):
            rw.load_checkpoint(path, model=train_model(big), map_location="cpu", restore_rng=False)
        step = rw.load_checkpoint(ckpt, model=train_model(big), map_location="cpu",
                                  restore_rng=False)["step"]  # fmt: skip
    except rw.ConfigError:
        return not saved  # nothing was saved yet: nothing to lose
    return not saved or step >= int(saved[-1])


@cache
def _script():
    """The training script as a module (its model, to load the checkpoints into)."""
    spec = importlib.util.spec_from_file_location("cluster_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start(cluster: Cluster, folder: Path, *extra: str, env=None, **flags) -> list[jobs.Launcher]:
    return jobs.start_job(cluster, [str(SCRIPT), str(folder), *TRAIN_FLAGS, *extra], folder,
                          env=env, **flags)  # fmt: skip


def node_killed(
    folder: Path, victim: int = 1, *, during_save: bool = False, nproc: int = 2
) -> dict:
    """2 nodes x ``nproc`` workers; every process of node ``victim`` SIGKILLed mid-step (or
    while rank 0 writes a checkpoint: ``during_save``). The survivors must stop at once (not
    at the 120 s timeout) and their launcher must name the node and its ranks."""
    big = ["--big"] if during_save else []
    with Cluster(2) as cluster:
        launchers = start(cluster, folder, "--timeout", "120", *big, nproc=nproc)
        started = wait_until(lambda: steps(folder) >= 8, 300)
        mid_write = None
        if during_save and started is not None:
            tmp = folder / "ckpt"
            mid_write = wait_until(lambda: any(tmp.glob(".ckpt-*.tmp")), 120, poll=0.01)
        else:
            time.sleep(random.uniform(0.0, 0.5))  # a random moment of a step
        begin = time.monotonic()
        cluster.kill(victim)
        survivor = launchers[1 - victim]
        code = survivor.wait(150)
        stop_s = time.monotonic() - begin
        if code is None:
            survivor.proc.kill()
        err = survivor.stderr
    summary = _summary(err)
    ranks = [victim * nproc + i for i in range(nproc)]
    ranks = f"rank{'s' if nproc > 1 else ''} {', '.join(map(str, ranks))}"
    # Node 0 holds the store: the survivors hear it close, not its ranks' heartbeats stop.
    named = "node 0 (the master's machine" if victim == 0 else f"node {victim} ({ranks})"
    return {
        "seconds": None if code is None else round(stop_s, 2),
        "hung": started is None or code is None,
        "lost": not checkpoint_ok(folder, bool(big)),
        "mid_write": mid_write is not None,
        "named": summary.startswith(f"rankwise run: {named}") and "stopped responding" in summary,
        "code": code,
        "summary": summary,
    }


def _stall_line(text: str) -> str:
    for line in text.splitlines():
        if "stall:" in line:
            return line
    return ""


def _summary(text: str) -> str:
    return text[text.rfind("rankwise run: ") :] if "rankwise run: " in text else ""


def partitioned(folder: Path, *, stall_s: float, timeout: float, rdzv: str = "static") -> dict:
    """2 nodes x 1 worker; node 1's link cut mid-step, silently (packets vanish) and for good.
    Node 0 must report the stall naming node 1 (``seconds``: from the cut), and both nodes
    must end by the timeout plus the store's read limit, each naming what it lost (under
    c10d too, whose agents talk to their store while the job runs)."""
    env = {"RANKWISE_STALL_REPORT_S": str(stall_s)}
    port = 29500 if rdzv == "static" else 29400
    with Cluster(2) as cluster:
        launchers = start(cluster, folder, "--timeout", str(timeout), env=env, nproc=1,
                          rdzv=rdzv, port=port)  # fmt: skip
        started = wait_until(lambda: steps(folder) >= 8, 300)
        begin = time.monotonic()
        cluster.partition(1)
        stall = wait_until(lambda: "node 1" in _stall_line(launchers[0].stderr), timeout + 60)
        ends = [launcher.wait(timeout + 150) for launcher in launchers]
        end_s = time.monotonic() - begin
        errs = [launcher.stderr for launcher in launchers]
    return {
        "seconds": None if stall is None else round(stall, 2),
        "end_s": round(end_s, 2),
        "hung": started is None or None in ends,
        "lost": not checkpoint_ok(folder),
        "codes": ends,
        "stall": _stall_line(errs[0]),
        "summaries": [_summary(e) for e in errs],
        "cut_off_stall": _stall_line(errs[1]),
    }


def healed(folder: Path, *, cut_s: float, timeout: float, total: int = 40) -> dict:
    """2 nodes x 1 worker; node 1's link cut for ``cut_s`` s mid-step, then healed, before
    the timeout: training must go on to step ``total`` on both nodes, the replicas equal."""
    import torch

    with Cluster(2) as cluster:
        launchers = start(cluster, folder, "--timeout", str(timeout), "--steps", str(total),
                          nproc=1)  # fmt: skip
        started = wait_until(lambda: steps(folder) >= 8, 300)
        cut_at = steps(folder)
        cluster.partition(1)
        time.sleep(cut_s)
        cluster.heal()
        begin = time.monotonic()
        ends = [launcher.wait(timeout + 150) for launcher in launchers]
        end_s = time.monotonic() - begin
    states = [torch.load(folder / f"rank{r}.pt", weights_only=True)
              for r in (0, 1) if (folder / f"rank{r}.pt").exists()]  # fmt: skip
    equal = len(states) == 2 and all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    return {
        "seconds": round(end_s, 2),
        "hung": started is None or None in ends,
        "lost": not checkpoint_ok(folder),
        "codes": ends,
        "cut_at": cut_at,
        "steps": steps(folder),
        "replicas_equal": equal,
        "diverged": len(states) == 2 and not equal,
    }


def node_replaced(folder: Path, *, total: int = 40) -> dict:
    """``--nnodes 1:2 --max-restarts 1`` over c10d, 2 nodes x 1 worker; node 1 killed mid-
    step and a replacement started on it at once. The job must recover from the last
    checkpoint and end equal, bit for bit, to an uninterrupted run (one node, 2 workers: the
    same sums; started beside it). ``seconds``: from the kill to the job's end."""
    import torch

    straight, cut = folder / "straight", folder / "replaced"
    straight.mkdir(), cut.mkdir()
    args = [str(SCRIPT), "--steps", str(total), "--save-every", "5", "--timeout", "60"]
    reference = subprocess.Popen(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", *args, str(straight)],
        cwd=straight, env=jobs.rankwise_env(straight), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    elastic = {"nproc": 1, "nnodes": "1:2", "rdzv": "c10d", "port": 29400}

    def launch(cluster: Cluster, node: int, name: str) -> jobs.Launcher:
        flags = [*jobs.run_flags(cluster, node, **elastic), "--max-restarts", "1"]
        return jobs.start(cluster, node, [*flags, *args, "--sleep", "0.1", str(cut)], cut,
                          name=name)  # fmt: skip

    with Cluster(2) as cluster:
        first = [launch(cluster, n, f"node{n}") for n in (1, 0)][::-1]
        started = wait_until(lambda: steps(cut) >= 12, 300)
        cluster.kill(1)
        begin = time.monotonic()
        replacement = launch(cluster, 1, "node1-replacement")
        ends = [first[0].wait(300), replacement.wait(300)]
        end_s = time.monotonic() - begin
        out = first[0].stdout + replacement.stdout
    ref_code = reference.wait(300)
    want = torch.load(straight / "rank0.pt", weights_only=True) if ref_code == 0 else None
    got = [torch.load(cut / f"rank{r}.pt", weights_only=True) for r in (0, 1)
           if (cut / f"rank{r}.pt").exists()]  # fmt: skip
    exact = want is not None and len(got) == 2 and all(
        torch.equal(g[k], want[k]) for g in got for k in want
    )
    resumed = [line for line in out.splitlines() if "resumed from step" in line]
    return {
        "seconds": round(end_s, 2),
        "hung": started is None or None in ends or ref_code is None,
        "lost": not checkpoint_ok(cut),
        "codes": ends,
        "bit_exact": exact,
        "diverged": not exact,
        "resumed": resumed,
        "summary": _summary(first[0].stderr),
    }
