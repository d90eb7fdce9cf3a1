"""Cost of the step anatomy (``rankwise.timing``): timing on at the default cadence (a record
every 10 steps), every step (``--profile-steps``), and off, on the same job.

Two Gloo ranks train an MLP with our DDP through ``rt.prepare`` (the README loop). Two ways
to the figure:

- **A/B**: the median step time of the job with timing off, at the default cadence and dense,
  repeats interleaved (off, default, dense, then the reverse: each repeat's modes run side by
  side in time), and the median over repeats of each repeat's own ratio to its off run
  (``ab_paired``). On a shared machine its noise is larger than the effect: read it with the
  load (``os.getloadavg()``, recorded before and after).
- **Direct**: what timing adds per step, measured in the job itself: the hooks' work on one
  step (the spans, the bucket marks, closing the step; timed over 20k simulated steps) and one
  record (posting the all-gather of every rank's vector, then, a step later, taking its table,
  the attribution, rank 0's writes; timed over 50 records, a 20 ms sleep standing for the step
  between), amortised at the cadence, over the job's step time with timing off.
  ``record_sync_us``: the same record waited for at once (before the gather overlapped a step).
  Each figure twice: wall time, and the loop thread's CPU time (``*_cpu``): on a loaded machine
  the wall time of a few hundred microseconds of Python also counts the time the thread was
  descheduled, which is the machine's, not the timing's. The hooks are timed with one step in
  ten armed (the CPU clock read), as at the default cadence; ``hooks_dense`` with every step.

    flock /tmp/rw-bench.lock python benchmarks/step_anatomy.py --out benchmarks/results/step_anatomy.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

STEPS, WARMUP = 210, 10


def _job(folder: str) -> dict:
    """One rank: the README loop; per-step wall times, then the direct costs."""
    import torch
    from torch import nn

    import rankwise as rw

    torch.set_num_threads(1)
    rt = rw.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10))  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.randn(64 * STEPS, 512),
                                          torch.randint(0, 10, (64 * STEPS,)))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = rt.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=32))
    times, last = [], time.perf_counter()
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        now = time.perf_counter()
        times.append(now - last)
        last = now
        if len(times) == STEPS:
            break
    out = {"step_s": statistics.median(times[WARMUP:]), "mean_s": statistics.mean(times[WARMUP:])}
    rec = rt.loop.timing
    if rec is not None:
        out.update(_direct(rec, len(model.reducer.buckets)))
    rw.shutdown()
    return out


def _direct(rec, buckets: int) -> dict:
    """Seconds of timing work per step (hooks) and per record (gather + attribution + write),
    wall and the loop thread's CPU (``time.thread_time``: what the timing itself spends, not
    the time the thread was descheduled on a loaded machine)."""
    hooks = {"default": _hooks(rec, buckets, 10), "dense": _hooks(rec, buckets, 1)}
    t = time.perf_counter()
    for _ in range(50):
        rec.record()
    sync = (time.perf_counter() - t) / 50
    spent = cpu = 0.0
    for _ in range(50):
        t, c = time.perf_counter(), time.thread_time()
        rec._post()
        spent, cpu = spent + time.perf_counter() - t, cpu + time.thread_time() - c
        time.sleep(0.02)  # the next step's compute, while the gather runs
        t, c = time.perf_counter(), time.thread_time()
        rec._complete()
        spent, cpu = spent + time.perf_counter() - t, cpu + time.thread_time() - c
    return {"hooks_s": hooks, "record_s": spent / 50, "record_cpu_s": cpu / 50,
            "record_sync_s": sync, "buckets": buckets}


def _hooks(rec, buckets: int, every: int) -> tuple[float, float]:
    """(wall, CPU) seconds of the hooks' work on one step, over 20k simulated steps of which
    one in ``every`` is armed (reads the CPU clock), as the recorder arms them."""
    from rankwise.timing import clock

    c, n = rec.clock, 20_000
    t, cpu = time.perf_counter(), time.thread_time()
    for i in range(n):
        c.arm(i % every == every - 1)
        for phase in ("data", "forward", "backward"):
            clock.begin(phase)
            clock.end(phase)
        for _ in range(buckets):
            clock.bucket_ready()
        with clock.span("blocked", any_thread=True):
            pass
        clock.begin("optimizer")
        clock.end("optimizer")
        rec.window.add(c.finish_step())
    return (time.perf_counter() - t) / n, (time.thread_time() - cpu) / n


def _run(mode: str, folder: str) -> dict:
    from rankwise.testing import run_distributed

    env = {"RANKWISE_PROFILE_STEPS": mode, "RANKWISE_RUN_DIR": folder}
    return run_distributed(_job, 2, args=(folder,), timeout=600, env=env)[0]


def _at(value, at: tuple) -> float:
    for key in at:
        value = value[key]
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    modes = {"off": "0", "default": "10", "dense": "1"}
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="rankwise-anatomy-") as d:
        for i in range(args.repeats):
            order = list(modes) if i % 2 == 0 else list(reversed(modes))
            for m in order:
                runs[m].append(_run(modes[m], f"{d}/{m}-{i}"))
    step_off = statistics.median(r["step_s"] for r in runs["off"])
    result = {"steps": STEPS - WARMUP, "repeats": args.repeats, "world": 2, "engine": "ddp",
              "step_ms": {m: round(statistics.median(r["step_s"] for r in runs[m]) * 1e3, 3)
                          for m in modes}}  # fmt: skip
    result["ab_overhead"] = {m: round(result["step_ms"][m] / result["step_ms"]["off"] - 1, 4)
                             for m in ("default", "dense")}  # fmt: skip
    result["ab_paired"] = {m: round(statistics.median(
        a["step_s"] / b["step_s"] - 1 for a, b in zip(runs[m], runs["off"], strict=True)), 4)
        for m in ("default", "dense")}  # fmt: skip
    result["ab_paired_each"] = {m: [round(a["step_s"] / b["step_s"] - 1, 4)
                                    for a, b in zip(runs[m], runs["off"], strict=True)]
                                for m in ("default", "dense")}  # fmt: skip
    def med(key, *at):
        return statistics.median(_at(r[key], at) for r in runs["default"])

    hooks, hooks_cpu = med("hooks_s", "default", 0), med("hooks_s", "default", 1)
    dense, dense_cpu = med("hooks_s", "dense", 0), med("hooks_s", "dense", 1)
    record, record_cpu, sync = med("record_s"), med("record_cpu_s"), med("record_sync_s")
    result["direct"] = {
        "hooks_us_per_step": round(hooks * 1e6, 2), "hooks_cpu_us_per_step": round(hooks_cpu * 1e6, 2),
        "hooks_dense_us_per_step": round(dense * 1e6, 2), "record_us": round(record * 1e6, 1),
        "record_cpu_us": round(record_cpu * 1e6, 1), "record_sync_us": round(sync * 1e6, 1),
        "overhead_default": round((hooks + record / 10) / step_off, 5),
        "overhead_default_cpu": round((hooks_cpu + record_cpu / 10) / step_off, 5),
        "overhead_dense": round((dense + record) / step_off, 5),
        "overhead_dense_cpu": round((dense_cpu + record_cpu) / step_off, 5),
    }  # fmt: skip
    result["loadavg_before"], result["loadavg_after"] = load_before, os.getloadavg()
    result["machine"] = f"{os.cpu_count()} CPUs, shared with other jobs (not a quiet run)"
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
