"""The failure-report faults of issue 34 for benchmarks/faults.py: does the report tell the truth?

Each function runs one trial over real processes (``rankwise run``, Gloo) and returns
``{"lost", "hung", "seconds", ...}`` plus the facts its row counts:

- ``raise_rank0`` / ``raise_rank1``: rank r raises ValueError at step 50 under DDP. ``misblamed``
  counts runs whose headline does not name rank r and its exception first, or that say
  "finished normally", "never reached" or blame `if rank == 0:`; ``noisy`` counts runs that
  print Gloo's "GLHF" noise, a caret line or more than one Fix. Seconds: from the raise to
  the job's end.
- ``uneven_data``: 80 vs 48 samples per rank, a plain DataLoader, no join. ``misblamed``: the
  headline does not say uneven data or the Fix does not name rw.loader and join().
- ``rogue_call_site``: 3 ranks; rank 1's heartbeat names /dev/zero as its call site, rank 2's
  a FIFO, and rank 0 then times out in a collective. ``opened`` counts trials in which rank 0
  opened either (a Python audit hook sees every ``open``); ``hung``: no diagnosis. Seconds:
  from the timeout to the diagnosis.
- ``raw_mismatch``: ``dist.all_reduce`` on rank 0, ``dist.recv`` on rank 1, a 600 s timeout.
  Seconds: from the stall report to the job's end (``end_s``: from the mismatch to the end).
- ``ps_worker_drop``: 3 ranks, asynchronous updates with staleness 2; rank 1 pushes, then stops
  receiving. Seconds: from its push to the server dropping it (stall_timeout's default, 8 s: within 10 s);
  ``lost``: ranks 0 and 2 did not finish their steps before rank 1 came back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

RAISES = textwrap.dedent("""
    import os, time, torch, rankwise as rw
    rt = rw.init(timeout=60)
    model = rw.DistributedDataParallel(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(100):
        if step == 50 and rt.rank == int(os.environ["RAISER"]):
            open("raised", "w").write(repr(time.time()))
            raise ValueError(f"bad batch at step {step}")
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
""")

UNEVEN = textwrap.dedent("""
    import torch, rankwise as rw
    from torch.utils.data import DataLoader, TensorDataset
    rt = rw.init(timeout=60)
    n = 80 if rt.rank == 0 else 48
    loader = DataLoader(TensorDataset(torch.randn(n, 8), torch.randn(n, 2)), batch_size=8)
    model = rw.DistributedDataParallel(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
""")

ROGUE = textwrap.dedent("""
    import json, os, sys, time, torch, rankwise as rw
    from rankwise.diagnose import fingerprints as fp, sidechannel as sc
    rt = rw.init(timeout=8)
    fifo, names, opened = os.path.abspath("pipe"), ("/dev/zero", os.path.abspath("pipe")), []
    sys.addaudithook(lambda ev, args: ev == "open" and str(args[0]) in names
                     and opened.append(str(args[0])))
    rw.all_reduce_sum(torch.ones(3))
    if rt.rank == 2:
        os.mkfifo(fifo)
    rw.barrier()
    if rt.rank != 0:
        fp.STATE.watchdog.stopped.set()
        fp.STATE.watchdog.join(10)
        site = ["/dev/zero", 1, "main"] if rt.rank == 1 else [fifo, 1, "main"]
        rec = {"seq": 3, "op": "all_reduce", "sig": "sum, float32[3]", "label": None,
               "site": site, "state": "entered", "digest": 5}
        beat = {"t": time.time() + 3600, "groups": {"world": [rec]}}
        fp.STATE.channel.set(sc.key_state(rt.rank), json.dumps(beat))
        time.sleep(20)
        sys.exit(0)
    time.sleep(1.0)
    began = time.time()
    try:
        rw.all_reduce_sum(torch.ones(3))
    except rw.DistributedError as exc:
        done = time.time()
        json.dump({"text": str(exc), "opened": opened, "s": done - began - 8.0},
                  open("rank0.json", "w"))
""")

RAW = textwrap.dedent("""
    import time, torch, torch.distributed as dist, rankwise as rw
    rt = rw.init(timeout=600)
    t = torch.ones(4)
    open(f"in{rt.rank}", "w").write(repr(time.time()))
    if rt.rank == 0:
        dist.all_reduce(t)
    else:
        dist.recv(t, src=0)
""")

PS = textwrap.dedent("""
    import json, time, torch, rankwise as rw
    from rankwise.updates.protocol import Kind, Message
    rt = rw.init(timeout=120)
    model = torch.nn.Linear(3, 1)
    opt = rw.updates.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "async",
                          staleness=2, timeout=120)
    if rt.rank == 1:
        model(torch.ones(2, 3)).sum().backward()
        opt._wire.send(0, Message(Kind.PUSH, 1, opt._version, opt.steps, opt.flat.grads()))
        open("pushed", "w").write(repr(time.time()))
        time.sleep(40)
        open("woke", "w").write(repr(time.time()))
        raise SystemExit(0)
    dropped_at = None
    for step in range(30):
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        stats = opt.server_stats()
        if dropped_at is None and stats is not None and stats.dropped:
            dropped_at = time.time()
    opt.close()
    json.dump({"steps": opt.steps, "done": time.time(), "dropped_at": dropped_at},
              open(f"rank{rt.rank}.json", "w"))
""")


def _run(tmp: Path, script: str, text: str, env: dict, n: int = 2, **extra: str):
    (tmp / script).write_text(text)
    return subprocess.Popen(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", str(n), script],
        cwd=tmp, env={**env, **extra}, text=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip


def _noisy(err: str) -> bool:
    bare = [ln.split(":", 1)[-1].strip() for ln in err.splitlines()]
    carets = [ln for ln in bare if ln and set(ln) <= set("^~")]
    return "GLHF" in err or bool(carets) or err.count("Fix: ") != 1


def raise_rank(tmp: Path, env: dict, raiser: int) -> dict:
    job = _run(tmp, "train.py", RAISES, env, RAISER=str(raiser))
    try:
        _, err = job.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        job.kill()
        return {"lost": False, "hung": True, "seconds": None, "misblamed": 1, "noisy": 0}
    ended = time.time()
    raised = float((tmp / "raised").read_text())
    summary = err[err.index("rankwise run: ") :] if "rankwise run: " in err else ""
    right = summary.startswith(
        f"rankwise run: rank {raiser} raised ValueError: bad batch at step 50"
    )
    wrong = any(s in err for s in ("finished normally", "never reached", "if rank == 0"))
    return {"lost": False, "hung": False, "seconds": ended - raised,
            "misblamed": int(not right or wrong), "noisy": int(_noisy(err))}  # fmt: skip


def uneven_data(tmp: Path, env: dict) -> dict:
    _, err = _run(tmp, "uneven.py", UNEVEN, env).communicate(timeout=240)
    summary = err[err.index("rankwise run: ") :] if "rankwise run: " in err else ""
    fix = summary[summary.index("Fix: ") :] if "Fix: " in summary else ""
    right = summary.startswith("rankwise run: uneven data: rank(s) 1 ran out of batches")
    right = right and "rw.loader(" in fix and "join()" in fix and "if rank == 0" not in err
    return {"lost": False, "hung": False, "seconds": None, "misblamed": int(not right),
            "noisy": int(_noisy(err))}  # fmt: skip


def rogue_call_site(tmp: Path, env: dict) -> dict:
    job = _run(tmp, "rogue.py", ROGUE, env, n=3)
    try:
        job.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        job.kill()
    out = tmp / "rank0.json"
    if not out.exists():
        return {"lost": False, "hung": True, "seconds": None, "opened": 0}
    got = json.loads(out.read_text())
    named = "zero:1" in got["text"] and "pipe:1" in got["text"]
    return {
        "lost": False,
        "hung": not named,
        "seconds": got["s"],
        "opened": int(bool(got["opened"])),
    }


def raw_mismatch(tmp: Path, env: dict, stall_s: float) -> dict:
    job = _run(tmp, "raw.py", RAW, env, RANKWISE_STALL_REPORT_S=str(stall_s))
    reported = None
    lines = []
    for line in job.stderr:
        lines.append(line)
        if reported is None and "stall in a torch.distributed collective" in line:
            reported = time.time()
    try:
        job.wait(timeout=30)
    except subprocess.TimeoutExpired:
        job.kill()
        return {"lost": False, "hung": True, "seconds": None}
    ended = time.time()
    entered = max(float((tmp / f"in{r}").read_text()) for r in (0, 1))
    return {"lost": False, "hung": reported is None, "end_s": ended - entered,
            "seconds": None if reported is None else ended - reported}  # fmt: skip


def ps_worker_drop(tmp: Path, env: dict) -> dict:
    job = _run(tmp, "ps.py", PS, env, n=3)
    try:
        job.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        job.kill()
    outs = [tmp / f"rank{r}.json" for r in (0, 2)]
    if not all(p.exists() for p in outs) or not (tmp / "woke").exists():
        return {"lost": True, "hung": True, "seconds": None}
    r0, r2 = (json.loads(p.read_text()) for p in outs)
    pushed, woke = float((tmp / "pushed").read_text()), float((tmp / "woke").read_text())
    finished = r0["steps"] == r2["steps"] == 30 and max(r0["done"], r2["done"]) < woke
    drop = None if r0["dropped_at"] is None else r0["dropped_at"] - pushed
    return {"lost": not finished, "hung": drop is None, "seconds": drop}


def plan(env: dict, stall_s: float, tmp, trials: int = 3) -> dict:
    """The rows, for faults.py's plan: fault name -> a function returning its trials."""
    raw_trials = trials if stall_s < 30 else 1  # a trial takes the stall window and more
    return {
        "raise_rank0": lambda: [raise_rank(tmp(), env, 0) for _ in range(trials)],
        "raise_rank1": lambda: [raise_rank(tmp(), env, 1) for _ in range(trials)],
        "uneven_data": lambda: [uneven_data(tmp(), env) for _ in range(trials)],
        "rogue_call_site": lambda: [rogue_call_site(tmp(), env) for _ in range(trials)],
        "raw_mismatch": lambda: [raw_mismatch(tmp(), env, stall_s) for _ in range(raw_trials)],
        "ps_worker_drop": lambda: [ps_worker_drop(tmp(), env) for _ in range(trials)],
    }


def counts(results: list[dict]) -> dict:
    """This module's facts, summed over the trials (``end_s``: the worst)."""
    found = {k: sum(int(r[k]) for r in results) for k in ("misblamed", "noisy", "opened")
             if any(k in r for r in results)}  # fmt: skip
    ends = [r["end_s"] for r in results if r.get("end_s") is not None]
    if ends:
        found["end_s_max"] = round(max(ends), 2)
    return found
