"""Fault injection: kills, kills during saves, fuzzed parameter-server frames, a hang.

Each fault is injected ``trials`` times into a small real job and the outcome is checked:

- ``sigkill_rank``: a training job (2 ranks, our DDP, a checkpoint every 5 steps) has rank 1
  SIGKILLed at a random step; the launcher must stop within 10 s, and the folder's ``latest``
  checkpoint must load and be no older than the last save that returned.
- ``sigkill_launcher``: the same job has its launcher SIGKILLed; every worker must be gone
  within 10 s, and the checkpoint must load.
- ``kill_during_save``: a process saving a ~17 MB model into a folder in a loop is SIGKILLed at
  a random moment; ``load_checkpoint(folder)`` must give the last completed save (or a later
  one), and the next save must leave no temporary file.
- ``fuzzed_ps_frames``: random frames (random bytes, truncated, wrong kinds and ranks) reach a
  live parameter server from worker 1; the server must either serve a valid one or stop
  every worker, naming rank 1, within 5 s, and never die silently.
- ``hang``: rank 1 sleeps before a collective; the stall report (``RANKWISE_STALL_REPORT_S``,
  rankwise's default unless --stall-s) must come within a minute of the sleep, before the
  timeout, and the final summary must blame rank 1. Its seconds count from the sleep.
- ``sigstop_rank`` (benchmarks/_faults_more.py, as the five below): rank 1 frozen with
  SIGSTOP while training with shared-memory buckets; seconds to the stall report naming it,
  and the final summary must blame it and list it as stopped by the launcher. ``stop_s_max``:
  seconds from rank 0 failing at its timeout to the end of the job (the frozen rank ended);
  ``end_after_report_s_max``: from the stall report to the end (the timeout is report + 15 s).
- ``kill_in_ddp_construction``: a random rank SIGKILLed while rank 0's shared-memory bucket
  file is named; seconds to stop, and ``shm_left`` counts files left in /dev/shm.
- ``kill_during_sharded_save``: rank 0 of a ZeRO-2 job (model + Adam, a 300 MB file) is
  SIGKILLed during a save; the job must stop, every ``ckpt-*.pt`` must load (``partial``
  counts those that do not), ``latest`` must be the last completed save, and the next save
  must remove the killed one's temporary file (``mid_write``: the trials where the kill
  landed inside the file's write, leaving one).
- ``kill_during_dcp_save``: the same with ``rw.save_checkpoint(..., sharded=True)``: both
  ranks write their shards into a DCP folder; every ``ckpt-*`` folder must load, ``latest``
  be the last completed save, and the next save remove the killed one's temporary folder.
- ``full_disk``: rank 0 saves past RLIMIT_FSIZE; every rank's error must name EFBIG and the
  file, and the previous checkpoint must load.
- ``rogue_rank``: rank 1 sends a pickle at DDP construction's model check; ``executed`` counts
  runs where it ran on rank 0, and the error must name rank 1.
- ``directory_bit``, ``word_swap``, ``rendezvous_forgery`` (benchmarks/_faults_security.py):
  the DOS directory bit set in a checkpoint's zip directory, two words swapped inside a tensor
  record (each must fail to load naming the file and record; ``lost`` counts silent loads,
  ``torch_silent`` what plain ``torch.load`` did), and an outsider's pickle written to a c10d
  job's rendezvous key (``executed`` counts runs where it ran; the job must stop naming the key).
- ``raise_rank0``, ``raise_rank1``, ``uneven_data``, ``rogue_call_site``, ``raw_mismatch``,
  ``ps_worker_drop`` (benchmarks/_faults_report.py): whether the failure report tells the
  truth (``misblamed``: a headline that does not name the rank that raised, or blames one
  that did not fail; ``noisy``: Gloo's noise, caret lines, more than one Fix; ``opened``: a
  file a peer named was opened), and how soon a raw deadlock or a deaf worker ends.
- ``--matrix`` (benchmarks/_faults_matrix.py, root only): the fault matrix, every fault crossed
  with topology, bucket size and strategy; benchmarks/results/fault_matrix.json.
- ``node_killed``, ``node_killed_mid_save``, ``link_cut``, ``link_healed``, ``node_replaced``
  (benchmarks/_faults_cluster.py, root only, run when named in ``--only``): several machines as
  network namespaces; a node killed, the link cut or healed, a node replaced.

Prints one JSON row per fault: trials, runs that lost data or hung (and, where they apply,
executed payloads, shared-memory files left, errors that did not name the cause), and the
worst and median seconds to stop (or to report, for the hang and the frozen rank). --out also
writes the JSON to a file.

    flock /tmp/bench.lock python benchmarks/faults.py --out benchmarks/results/faults.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _report import wait_until  # beside this script

SRC = str(Path(__file__).resolve().parents[1] / "src")
sys.path.insert(0, SRC)  # this checkout's rankwise, here and in the jobs (ENV)
ENV = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}

TRAIN = textwrap.dedent("""
    import os, sys, time, torch, rankwise as rw
    from torch import nn
    rt = rw.init(timeout=30)
    torch.manual_seed(0)
    model = rw.DistributedDataParallel(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    open(f"pid{rt.rank}", "w").write(str(os.getpid()))
    for step in range(1, 100000):
        model(torch.randn(4, 8)).sum().backward()
        opt.step(); opt.zero_grad()
        if step % 5 == 0:
            rw.save_checkpoint("ckpt", model=model, optimizer=opt, step=step)
            if rt.rank == 0:
                with open("saved", "a") as f:
                    f.write(f"{step}\\n")
        time.sleep(0.02)
""")

SAVER = textwrap.dedent("""
    import sys, torch, rankwise as rw
    from torch import nn
    model = nn.Linear(1024, 4096)  # ~17 MB of float32
    step = 0
    while True:
        step += 1
        rw.save_checkpoint(sys.argv[1], model=model, step=step, keep_last=2)
        print(step, flush=True)
""")

HANG = textwrap.dedent("""
    import sys, time, torch, rankwise as rw
    rt = rw.init(timeout=float(sys.argv[1]))
    rw.all_reduce_sum(torch.ones(3))
    if rt.rank == 1:
        open("sleeping", "w").write(repr(time.time()))
        time.sleep(300)
    rw.all_reduce_sum(torch.ones(3))
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _checkpoint_ok(folder: Path) -> bool:
    """The folder's latest checkpoint loads and is no older than the last save that returned."""
    import rankwise as rw

    saved = folder.parent / "saved"
    last = int(saved.read_text().split()[-1]) if saved.exists() and saved.read_text() else None
    try:
        step = rw.load_checkpoint(folder, map_location="cpu", restore_rng=False)["step"]
    except rw.ConfigError:
        return last is None  # nothing was saved yet: nothing to lose
    return last is None or step >= last


def _start_training(tmp: Path) -> tuple[subprocess.Popen, list[int]]:
    (tmp / "train.py").write_text(TRAIN)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", "train.py"],
        cwd=tmp, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    pids = [tmp / "pid0", tmp / "pid1"]
    if wait_until(lambda: all(p.exists() and p.read_text() for p in pids), 120) is None:
        launcher.kill()
        raise RuntimeError("the training job never started")
    wait_until(lambda: (tmp / "saved").exists(), 60)
    time.sleep(random.uniform(0.0, 1.5))  # a random step
    return launcher, [int(p.read_text()) for p in pids]


def sigkill_rank(tmp: Path) -> dict:
    launcher, workers = _start_training(tmp)
    os.kill(workers[1], signal.SIGKILL)
    took = wait_until(lambda: launcher.poll() is not None, 60)
    if took is None:
        launcher.kill()
    return {"lost": not _checkpoint_ok(tmp / "ckpt"), "hung": took is None, "seconds": took}


def sigkill_launcher(tmp: Path) -> dict:
    launcher, workers = _start_training(tmp)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    took = wait_until(lambda: not any(_alive(w) for w in workers), 60)
    for w in workers:
        if _alive(w):
            os.kill(w, signal.SIGKILL)
    return {"lost": not _checkpoint_ok(tmp / "ckpt"), "hung": took is None, "seconds": took}


def kill_during_save(tmp: Path) -> dict:
    (tmp / "saver.py").write_text(SAVER)
    folder = tmp / "ckpt"
    proc = subprocess.Popen([sys.executable, "saver.py", str(folder)], cwd=tmp, env=ENV,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    proc.stdout.readline()  # one save completed
    time.sleep(random.uniform(0.0, 1.0))  # usually mid-write: a save takes about as long
    proc.kill()
    completed = [int(x) for x in [1, *proc.stdout.read().split()]]
    proc.wait()
    (tmp / "saved").write_text(f"{completed[-1]}\n")
    ok = _checkpoint_ok(folder)
    import torch

    import rankwise as rw

    # The next save (any process) must clear what the killed one left.
    rw.save_checkpoint(folder, model=torch.nn.Linear(2, 2), step=completed[-1] + 1)
    leftovers = list(folder.glob(".*.tmp"))
    return {"lost": not ok or bool(leftovers), "hung": False, "seconds": None}


def fuzzed_ps_frames(trials: int) -> list[dict]:
    from _ps_fuzz import run_fuzz  # beside this script

    return run_fuzz(trials)


def hang(tmp: Path, stall_s: float | None) -> dict:
    from rankwise.job import env as envmod

    (tmp / "hang.py").write_text(HANG)
    env = dict(ENV) if stall_s is None else {**ENV, "RANKWISE_STALL_REPORT_S": str(stall_s)}
    timeout = 2 * (envmod.STALL_REPORT_S if stall_s is None else stall_s) + 10
    proc = subprocess.Popen(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", "hang.py", str(timeout)],
        cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    reported, lines = None, []
    for line in proc.stderr:
        lines.append(line)
        if reported is None and "stall: rank(s) 1 have not reached" in line:
            reported = time.time() - float((tmp / "sleeping").read_text())
    proc.wait(120)
    text = "".join(lines)
    blamed = "rankwise run: rank(s) 1 never reached" in text
    return {"lost": False, "hung": reported is None or not blamed, "seconds": reported}


def _row(fault: str, results: list[dict], **extra) -> dict:
    secs = [r["seconds"] for r in results if r["seconds"] is not None]
    counted = {
        key: sum(int(r[key]) for r in results)
        for key in ("executed", "shm_left", "unnamed", "partial", "mid_write", "diverged",
                    "torch_silent")
        if any(key in r for r in results)
    }
    worst = {  # facts some rows measure besides their seconds: the worst trial's
        f"{key}_max": round(max(r[key] for r in results if r.get(key) is not None), 2)
        for key in ("stop_s", "end_after_report_s", "save_s", "file_mb", "end_s")
        if any(r.get(key) is not None for r in results)
    }
    return {
        "fault": fault,
        "trials": len(results),
        "lost_data": sum(r["lost"] for r in results),
        "hung": sum(r["hung"] for r in results),
        **counted,
        "max_s": round(max(secs), 2) if secs else None,
        "median_s": round(statistics.median(secs), 2) if secs else None,
        **worst,
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3, help="trials per kill fault (default 3)")
    parser.add_argument("--saves", type=int, default=20, help="kills during saves (default 20)")
    parser.add_argument("--sharded", type=int, default=3,
                        help="kills during 300 MB sharded saves (default 3)")  # fmt: skip
    parser.add_argument("--frames", type=int, default=1000, help="fuzzed frames (default 1000)")
    parser.add_argument("--stall-s", type=float, default=None,
                        help="RANKWISE_STALL_REPORT_S for the hang (default: rankwise's, 50)")  # fmt: skip
    parser.add_argument("--only", nargs="*", default=None, help="run only these faults")
    parser.add_argument("--out", default=None)
    parser.add_argument("--matrix", action="store_true",
                        help="run the fault matrix instead (benchmarks/_faults_matrix.py; root) "
                        "into benchmarks/results/fault_matrix.json")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=3600.0,
                        help="--matrix: start no cell after this many seconds (the rest: not run)")
    parser.add_argument("--parallel", type=int, default=3, help="--matrix: cells at a time")
    parser.add_argument("--until", default=None,
                        help="--matrix: start no cell after this UTC time (HH:MM), whenever the "
                        "run began (it may wait for the benchmark lock)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="--matrix: the order of the cells")
    parser.add_argument("--resume", action="store_true",
                        help="--matrix: keep the cells the output file holds, run the rest")
    parser.add_argument("--rerun-failed", action="store_true",
                        help="--matrix --resume: run the file's failed cells again too")
    parser.add_argument("--faults", nargs="*", default=None,
                        help="--matrix: run only these faults' cells (e.g. host_killed)")
    args = parser.parse_args()
    if args.matrix:
        import _faults_matrix  # beside this script

        out = Path(args.out) if args.out else _faults_matrix.OUT
        budget = _faults_matrix.budget(args.budget_s, args.until)
        report = _faults_matrix.run(budget, args.parallel, args.seed, out, resume=args.resume,
                                    rerun_failed=args.rerun_failed, faults=args.faults)
        print(json.dumps({k: report.get(k) for k in ("counts", "times", "load")}, indent=1))
        return
    random.seed(0)
    import _faults_more as more  # beside this script
    import _faults_report as reports  # beside this script
    import _faults_security as security

    from rankwise.job.env import STALL_REPORT_S

    stall = STALL_REPORT_S if args.stall_s is None else args.stall_s
    plan = {
        "sigkill_rank": lambda: [sigkill_rank(_tmp()) for _ in range(args.kills)],
        "sigkill_launcher": lambda: [sigkill_launcher(_tmp()) for _ in range(args.kills)],
        "kill_during_save": lambda: [kill_during_save(_tmp()) for _ in range(args.saves)],
        "fuzzed_ps_frames": lambda: fuzzed_ps_frames(args.frames),
        "hang": lambda: [hang(_tmp(), args.stall_s)],
        "sigstop_rank": lambda: [more.sigstop_rank(_tmp(), ENV, stall) for _ in range(1)],
        "kill_in_ddp_construction": lambda: [
            more.kill_in_ddp_construction(_tmp(), ENV) for _ in range(args.kills)
        ],
        "kill_during_sharded_save": lambda: [
            more.kill_during_sharded_save(_tmp(), ENV) for _ in range(args.sharded)
        ],
        "kill_during_dcp_save": lambda: [
            more.kill_during_sharded_save(_tmp(), ENV, dcp=True) for _ in range(args.sharded)
        ],
        "full_disk": lambda: [more.full_disk(_tmp(), ENV)],
        "rogue_rank": lambda: [more.rogue_rank(_tmp(), ENV) for _ in range(args.kills)],
        **security.plan(ENV, _tmp, args.kills),  # directory_bit, word_swap, rendezvous_forgery
        **reports.plan(ENV, stall, _tmp, args.kills),
    }
    if args.only and set(args.only) & CLUSTER_ROWS:  # several machines: root only, minutes
        import _faults_cluster

        plan.update(_faults_cluster.plan(args.kills, stall, _tmp))
    rows = []
    for fault, run in plan.items():
        if args.only and fault not in args.only:
            continue
        began = time.monotonic()
        results = run()
        stalls = ("hang", "sigstop_rank", "raw_mismatch", "link_cut")
        extra = {"stall_report_s": stall} if fault in stalls else {}
        extra.update(reports.counts(results))
        rows.append(_row(fault, results, wall_s=round(time.monotonic() - began, 1), **extra))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    text = json.dumps(rows, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


CLUSTER_ROWS = {"node_killed", "node_killed_mid_save", "link_cut", "link_healed", "node_replaced"}
"""benchmarks/_faults_cluster.py's rows: asked for by name (``--only``), as they need root."""

_TMP: list[tempfile.TemporaryDirectory] = []


def _tmp() -> Path:
    d = tempfile.TemporaryDirectory(prefix="rankwise-faults-")
    _TMP.append(d)
    return Path(d.name)


if __name__ == "__main__":
    main()
