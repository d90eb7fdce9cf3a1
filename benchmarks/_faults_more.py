"""The faults of issue 27 for benchmarks/faults.py: frozen ranks, shared memory, full disks, rogues.

Each function runs one trial over real processes (``rankwise run``, Gloo) and returns
``{"lost", "hung", "seconds", ...}`` plus the facts its row counts: ``executed`` (a rogue's
pickle ran), ``shm_left`` (shared-memory files left in /dev/shm), ``unnamed`` (an error that
does not name the cause or the rank).
"""

from __future__ import annotations

import glob
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from _report import wait_until  # beside this script

SHM = "/dev/shm/rankwise-grads-"

FROZEN = textwrap.dedent("""
    import os, time, torch, rankwise as rw
    from torch import nn
    rt = rw.init(timeout=float(os.environ["JOB_TIMEOUT"]))
    torch.manual_seed(0)
    model = rw.DistributedDataParallel(nn.Linear(1024, 1024))  # 4 MiB: a shared-memory bucket
    assert model.reducer.shared is not None, "no shared-memory buckets"
    open(f"pid{rt.rank}", "w").write(str(os.getpid()))
    for step in range(100000):
        model(torch.randn(4, 1024)).sum().backward()
        time.sleep(0.01)
""")

IN_WINDOW = textwrap.dedent("""
    import os, time, torch, rankwise as rw
    from torch import nn
    from rankwise.parallel.ddp import shared_reduce, shm_file
    rt = rw.init(timeout=30)
    open(f"pid{rt.rank}", "w").write(str(os.getpid()))
    def pause():
        open(f"window{rt.rank}", "w").close()
        time.sleep(2)
    shm_file._IN_WINDOW = pause
    rw.DistributedDataParallel(nn.Linear(1024, 1024))
""")

FULL_DISK = textwrap.dedent("""
    import resource, torch, rankwise as rw
    from torch import nn
    rt = rw.init(timeout=30)
    model = nn.Linear(500, 500)
    rw.save_checkpoint("ckpt", model=model, step=1)
    if rt.rank == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))
    try:
        rw.save_checkpoint("ckpt", model=model, step=2)
    except rw.DistributedError as exc:
        print("ERROR", str(exc).splitlines()[0], flush=True)
""")

ROGUE = textwrap.dedent("""
    import os, torch, torch.distributed as dist, rankwise as rw
    from torch import nn
    from rankwise.diagnose import fingerprints
    class Payload:
        def __reduce__(self):
            return (os.makedirs, (os.path.abspath("pwned-by-rank-1"), 0o777, True))
    rt = rw.init(timeout=30)
    fingerprints.configure(checks=False)
    if rt.rank == 1:  # a rogue speaking stock torch at DDP construction's model check
        try:
            dist.all_gather_object([None, None], Payload())
        except Exception:
            pass
    else:
        rw.DistributedDataParallel(nn.Linear(4, 4))
""")


SHARDED = textwrap.dedent("""
    import os, time, torch, rankwise as rw
    from torch import nn
    rt = rw.init(timeout=60)
    torch.manual_seed(0)
    adam = lambda params: torch.optim.Adam(params, lr=1e-3)
    model = rw.ShardedDataParallel(nn.Linear(5000, 5000), adam, stage=2)  # 100 MB + Adam: 300 MB
    opt = model.optimizer
    model(torch.randn(4, 5000)).sum().backward()
    opt.step(); opt.zero_grad()
    open(f"pid{rt.rank}", "w").write(str(os.getpid()))
    def note(what):
        if rt.rank == 0:
            with open("saves", "a") as f:
                f.write(f"{what} {time.monotonic()}\\n")
    for step in range(1, 1000):
        note(f"saving {step}")
        rw.save_checkpoint("ckpt", model=model, optimizer=opt, step=step, keep_last=2,
                           sharded=SHARDED)
        note(f"saved {step}")
""")


def _launch(tmp: Path, script: str, text: str, env: dict, **popen) -> subprocess.Popen:
    (tmp / script).write_text(text)
    return subprocess.Popen(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", script],
        cwd=tmp, env=env, text=True, **popen,
    )  # fmt: skip




def _shm_of(pids: list[int]) -> list[str]:
    return [f for p in pids for f in glob.glob(f"{SHM}{p}-*")]


def sigstop_rank(tmp: Path, env: dict, stall_s: float) -> dict:
    """Rank 1 frozen (SIGSTOP) mid-training with shared-memory buckets: the stall report must
    name it within ``stall_s`` + a heartbeat; the job must end (the timeout, then the stop)."""
    timeout = stall_s + 15
    job = _launch(tmp, "frozen.py", FROZEN,
                  {**env, "RANKWISE_STALL_REPORT_S": str(stall_s), "JOB_TIMEOUT": str(timeout)},
                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    pids = [tmp / "pid0", tmp / "pid1"]
    if wait_until(lambda: all(p.exists() and p.read_text() for p in pids), 120) is None:
        job.kill()
        return {"lost": False, "hung": True, "seconds": None}
    time.sleep(random.uniform(0.2, 1.0))
    frozen_at = time.monotonic()
    os.kill(int(pids[1].read_text()), signal.SIGSTOP)
    rank0_gone = _when_gone(int(pids[0].read_text()))
    reported, lines = None, []
    for line in job.stderr:
        lines.append(line)
        if reported is None and "stall: rank(s) 1 " in line:
            reported = time.monotonic() - frozen_at
    job.wait(120)
    ended = time.monotonic()
    text = "".join(lines)
    blamed = "rank(s) 1 never reached" in text and "stopped by the launcher: rank(s) 1" in text
    # stop_s: from rank 0 failing at its timeout to the end of the job (the frozen rank ended)
    stop = ended - rank0_gone[0] if rank0_gone else None
    end = ended - frozen_at - reported if reported is not None else None
    return {"lost": False, "hung": reported is None, "seconds": reported, "unnamed": not blamed,
            "stop_s": stop, "end_after_report_s": end}  # fmt: skip


def _when_gone(pid: int) -> list[float]:
    """A list that gets the moment ``pid`` ends (watched by a thread)."""
    gone: list[float] = []

    def watch() -> None:
        while _alive(pid):
            time.sleep(0.02)
        gone.append(time.monotonic())

    threading.Thread(target=watch, daemon=True).start()
    return gone


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _saves(log: Path) -> list[tuple[str, int, float]]:
    text = log.read_text() if log.exists() else ""
    return [(w, int(n), float(t)) for w, n, t in (ln.split() for ln in text.splitlines())]


def _events(log: Path, what: str) -> dict[int, float]:
    return {n: t for w, n, t in _saves(log) if w == what}


def kill_during_sharded_save(tmp: Path, env: dict, dcp: bool = False) -> dict:
    """Rank 0 SIGKILLed in the middle of a 300 MB ZeRO-2 save (model + Adam; consolidated into
    one file, or with ``dcp`` each rank writing its shards into a DCP folder): the job stops,
    every checkpoint loads, ``latest`` is the last completed save, and the next save removes
    the killed one's temporary file (or folder)."""
    import torch

    import rankwise as rw

    script = SHARDED.replace("sharded=SHARDED", f"sharded={dcp}")
    job = _launch(tmp, "sharded.py", script, env,
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    log = tmp / "saves"
    if wait_until(lambda: 2 in _events(log, "saving"), 300) is None:
        job.kill()
        return {"lost": False, "hung": True, "seconds": None}
    took_once = _events(log, "saved")[1] - _events(log, "saving")[1]
    time.sleep(random.uniform(0.0, took_once))  # somewhere inside save 2 (or, rarely, 3)
    os.kill(int((tmp / "pid0").read_text()), signal.SIGKILL)
    killed = time.monotonic()
    stopped = wait_until(lambda: job.poll() is not None, 60)
    if stopped is None:
        job.kill()
    completed = max(_events(log, "saved"))
    folder = tmp / "ckpt"
    partial = 0
    for path in rw.list_checkpoints(folder):
        try:
            rw.load_checkpoint(path, map_location="cpu", restore_rng=False)
        except rw.ConfigError:
            partial += 1
    try:
        latest = rw.load_checkpoint(folder, map_location="cpu", restore_rng=False)["step"]
    except rw.ConfigError:
        latest = None
    left_by_kill = len(list(folder.glob(".*.tmp")))
    rw.save_checkpoint(folder, model=torch.nn.Linear(2, 2), step=completed + 10)
    leftovers = list(folder.glob(".*.tmp"))
    lost = latest is None or latest < completed or partial > 0 or bool(leftovers)
    return {"lost": lost, "hung": stopped is None, "seconds": stopped, "partial": partial,
            "mid_write": left_by_kill > 0, "save_s": took_once,
            "file_mb": max(_mb(p) for p in rw.list_checkpoints(folder)),
            "killed_after_s": killed - _events(log, "saving")[max(_events(log, "saving"))]}  # fmt: skip


def _mb(path: Path) -> float:
    files = [path] if path.is_file() else [f for f in path.iterdir() if f.is_file()]
    return sum(f.stat().st_size for f in files) / 1e6


def kill_in_ddp_construction(tmp: Path, env: dict) -> dict:
    """A random rank SIGKILLed while rank 0's shared-memory file is named: the job stops
    within seconds and nothing is left in /dev/shm."""
    job = _launch(tmp, "window.py", IN_WINDOW, env,
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    victim = random.choice([0, 1])
    marker = tmp / f"window{victim}"
    if wait_until(marker.exists, 120) is None:
        job.kill()
        return {"lost": False, "hung": True, "seconds": None}
    pids = [int((tmp / f"pid{r}").read_text()) for r in (0, 1)]
    os.kill(pids[victim], signal.SIGKILL)
    took = wait_until(lambda: job.poll() is not None, 60)
    if took is None:
        job.kill()
    return {"lost": False, "hung": took is None, "seconds": took, "shm_left": len(_shm_of(pids))}


def full_disk(tmp: Path, env: dict) -> dict:
    """A save past RLIMIT_FSIZE on rank 0: every rank's error names EFBIG and the file; the
    previous checkpoint still loads."""
    import rankwise as rw

    start = time.monotonic()
    job = _launch(tmp, "full.py", FULL_DISK, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, _ = job.communicate(timeout=180)
    errors = [ln for ln in out.splitlines() if "ERROR" in ln]
    named = len(errors) == 2 and all("EFBIG" in e and "ckpt-00000002.pt" in e for e in errors)
    try:
        lost = rw.load_checkpoint(tmp / "ckpt", map_location="cpu")["step"] != 1
    except rw.ConfigError:
        lost = True
    return {"lost": lost, "hung": False, "seconds": time.monotonic() - start, "unnamed": not named}


def rogue_rank(tmp: Path, env: dict) -> dict:
    """Rank 1 sends a pickle at DDP construction: nothing runs on rank 0, and the job stops
    naming rank 1."""
    start = time.monotonic()
    job = _launch(tmp, "rogue.py", ROGUE, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _, err = job.communicate(timeout=120)
        took = time.monotonic() - start
    except subprocess.TimeoutExpired:
        job.kill()
        _, err, took = "", "", None
    named = "rank 1 sent a model signature message" in err
    executed = (tmp / "pwned-by-rank-1").exists()
    return {"lost": False, "hung": took is None, "seconds": took, "executed": executed,
            "unnamed": not named}  # fmt: skip
