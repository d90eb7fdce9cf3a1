"""What in-memory replicas cost and save (docs/elastic.md), as JSON:

- ``overhead``: a 2-rank DDP job (Gloo, CPU; an MLP of ``--width`` with AdamW) timed in blocks
  of ``--steps`` steps, replication off and every K steps interleaved block by block
  (``--repeats`` rounds, so the machine's load drifts over all modes alike); the median step
  time of each mode and ``replication_overhead_pct`` against off. ``capture_ms``: the part on
  the training thread (one copy of the state into a buffer); the rest runs in a thread.
- ``zero`` (``--zero K``, on its own): per ZeRO stage at world 2, a replica's bytes and
  capture time (shards) against the consolidated state the replicas used to copy (the
  engine's ``state_dict``, a gather each time), the step's overhead at every K, and a restore
  at the same world:

    flock /tmp/rw-bench.lock python benchmarks/recovery.py --width 1024 --steps 30 --repeats 3 \
        --zero 10 --out benchmarks/results/recovery_zero.json
- ``--cluster-only --per-host 2 [--strategy zero3]``: the cluster trial alone, with two
  processes per host (worlds 6, 4 and 6 again, a global batch of 24 kept).
- ``cluster`` (root, network namespaces; ``--cluster``): tests/cluster/replicas.py's trial, 3
  hosts x 1 process under ``--nnodes 1:3`` with ``--rdzv-conf keep_alive_interval=1,
  keep_alive_max_attempt=4`` and a 1 s last call, a host killed, then a replacement, repeated
  ``--trials`` times: the medians of ``kill_to_training_s`` and ``grow_back_s``, the most
  ``steps_lost``, and each run with its ``phases_s`` (seconds from the kill to: the launcher
  reporting the failure, the new rendezvous round, a restarted worker's ``rt.prepare``, the
  first step trained at world 2).

    flock /tmp/rw-bench.lock python benchmarks/recovery.py --width 1024 --steps 50 --repeats 4 \
        --every 1,10,50 --cluster --out benchmarks/results/recovery.json

The machine's load average is recorded before and after: on a shared, loaded machine every
time here is longer than on a quiet one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import emit

import rankwise as rw
from rankwise.testing import run_distributed


def _block(rt, model, opt, steps: int, reps, start: int, dim: int | None = None) -> float:
    """Seconds per step over ``steps`` steps (replicating through ``reps`` when given)."""
    torch.manual_seed(start + 7919 * rt.rank)  # each rank its own batch, as a split loader's
    dim = dim or rw.unwrap_model(model)[0].in_features  # (zero3's bare module is empty)
    x, y = torch.randn(32, dim), torch.randint(0, 10, (32,))
    begin = time.perf_counter()
    for i in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if reps is not None:
            reps.step(start + i + 1)
    if reps is not None:
        reps.wait()
    rw.barrier()
    return (time.perf_counter() - begin) / steps


def _rss_mib() -> float:
    """This process's resident memory now (not its peak: the phases are compared)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def _folder_mib(folder: Path) -> float:
    """What the replica folder holds (tmpfs: RAM): this rank's copy and its buddy's."""
    return round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20, 1)


def _rank(folder: str, width: int, steps: int, repeats: int, everys: list) -> dict:
    rt = rw.init(strategy="ddp")
    torch.manual_seed(0)
    rss = {"init": _rss_mib()}
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 10))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = rt.prepare(model, opt)
    _block(rt, model, opt, 3, None, 0)  # warm-up: the optimizer's state exists
    rss["trained_without_replicas"] = _rss_mib()
    first = rt.replicas(
        model, opt, every=everys[0], folder=Path(folder) / f"k{everys[0]}-r{rt.rank}"
    )
    _block(rt, model, opt, 3, first, 3)  # one replicas object, three copies made
    rss["with_one_replicas"] = _rss_mib()
    reps = {everys[0]: first, **{k: rt.replicas(model, opt, every=k, folder=Path(folder) / f"k{k}-r{rt.rank}")
            for k in everys[1:]}}  # fmt: skip
    times: dict[str, list[float]] = {"off": [], **{str(k): [] for k in everys}}
    captures: list[float] = []
    step = 6
    for _ in range(repeats):
        for mode in times:
            r = None if mode == "off" else reps[mode if mode == "auto" else int(mode)]
            times[mode].append(_block(rt, model, opt, steps, r, step))
            step += steps
    for _ in range(5):
        t = time.perf_counter()
        reps[everys[0]].capture(step, None)
        captures.append(time.perf_counter() - t)
    size = reps[everys[0]].state_bytes
    rss["with_every_replicas"] = _rss_mib()
    held = _folder_mib(Path(folder) / f"k{everys[0]}-r{rt.rank}")
    for r in reps.values():
        r.close(remove=True)
    chosen = {"auto": reps["auto"].every} if "auto" in reps else {}  # every="auto"'s choice
    return {"times": times, "capture_s": statistics.median(captures), "state_bytes": size,
            "rss_mib": rss, "folder_mib": held, "chosen": chosen}  # fmt: skip


def overhead(width: int, steps: int, repeats: int, everys: list) -> dict:
    with tempfile.TemporaryDirectory(prefix="rw-recovery-") as folder:
        ranks = run_distributed(_rank, 2, args=(folder, width, steps, repeats, everys),
                                timeout=1800)  # fmt: skip
    times = ranks[0]["times"]
    chosen = ranks[0]["chosen"]
    step_s = {mode: statistics.median(v) for mode, v in times.items()}
    off = step_s["off"]
    return {
        "world": 2,
        "model": f"MLP {width}x{width}x2 + head, AdamW",
        "state_bytes_per_rank": ranks[0]["state_bytes"],
        # resident memory of each rank at each phase (MiB), and its replica folder in tmpfs
        # (its own copy and its buddy's): the RAM the replicas cost beside the training
        "rss_mib": [r["rss_mib"] for r in ranks],
        "replica_folder_mib": [r["folder_mib"] for r in ranks],
        "capture_ms": round(1000 * ranks[0]["capture_s"], 2),
        "step_ms": {mode: round(1000 * s, 2) for mode, s in step_s.items()},
        "replication_overhead_pct": {
            k: round(100 * (s - off) / off, 2) for k, s in step_s.items() if k != "off"
        },
        "cost_per_replication_ms": {  # the extra time of a block over off, per copy made
            k: round(1000 * (s - off) * int(chosen.get(k, k)), 2)
            for k, s in step_s.items()
            if k != "off"
        },
        "blocks": {mode: [round(1000 * t, 2) for t in v] for mode, v in times.items()},
        "auto_every": chosen.get("auto"),  # the interval every="auto" chose (the default)
        "steps_per_block": steps,
        "repeats": repeats,
    }


def _zero_rank(folder: str, strategy: str, width: int, steps: int, repeats: int,
               every: int) -> dict:  # fmt: skip
    """Under ZeRO: replicas of shards against the consolidated state the replicas copied
    before (``capture_state``, the engine's ``state_dict``: a gather on every copy)."""
    from rankwise.checkpoint.api import capture_state
    from rankwise.replicas import blob

    rt = rw.init(strategy=strategy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 10))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = rt.prepare(model, opt)
    _block(rt, model, opt, 3, None, 0, width)
    where = Path(folder) / f"{strategy}-r{rt.rank}"
    reps = rt.replicas(model, opt, every=every, folder=where)
    times: dict[str, list[float]] = {"off": [], str(every): []}
    step = 3
    for _ in range(repeats):
        for mode in times:
            times[mode].append(_block(rt, model, opt, steps, None if mode == "off" else reps,
                                      step, width))  # fmt: skip
            step += steps
    shards, whole, whole_bytes = [], [], 0
    for _ in range(5):
        rw.barrier()
        t = time.perf_counter()
        reps.capture(step, None)
        shards.append(time.perf_counter() - t)
        rw.barrier()
        t = time.perf_counter()
        whole_bytes = blob.encode(capture_state(**reps.objects, step=step, epoch=None), {}).numel()
        whole.append(time.perf_counter() - t)
    reps.close()
    rw.barrier()
    again = rt.replicas(model, opt, folder=where)
    t = time.perf_counter()
    got = again.restore()
    restore_s = time.perf_counter() - t
    again.close(remove=True)
    return {"times": times, "shards_bytes": reps.state_bytes, "whole_bytes": whole_bytes,
            "capture_s": statistics.median(shards), "whole_capture_s": statistics.median(whole),
            "restore_s": restore_s, "restored_step": got["step"]}  # fmt: skip


def zero(width: int, steps: int, repeats: int, every: int) -> dict:
    """Per ZeRO stage, world 2: a replica's bytes and capture time, shards against the
    consolidated state; the step's overhead at ``every``; a restore at the same world."""
    out = {}
    for strategy in ("zero1", "zero2", "zero3"):
        with tempfile.TemporaryDirectory(prefix="rw-recovery-") as folder:
            ranks = run_distributed(_zero_rank, 2, args=(folder, strategy, width, steps,
                                    repeats, every), init=False, timeout=1800)  # fmt: skip
        step_s = {m: statistics.median(v) for m, v in ranks[0]["times"].items()}
        off = step_s["off"]
        out[strategy] = {
            "replica_bytes_per_rank": [r["shards_bytes"] for r in ranks],
            "consolidated_bytes_per_rank": [r["whole_bytes"] for r in ranks],
            "capture_ms": [round(1000 * r["capture_s"], 2) for r in ranks],
            "consolidated_capture_ms": [round(1000 * r["whole_capture_s"], 2) for r in ranks],
            "step_ms": {m: round(1000 * v, 2) for m, v in step_s.items()},
            f"overhead_pct_every_{every}": round(100 * (step_s[str(every)] - off) / off, 2),
            "restore_same_world_s": [round(r["restore_s"], 3) for r in ranks],
            "blocks_ms": {m: [round(1000 * t, 2) for t in v] for m, v in ranks[0]["times"].items()},
        }
    return {"world": 2, "model": f"MLP {width}x{width}x2 + head, AdamW", "every": every,
            "steps_per_block": steps, "repeats": repeats, "stages": out}  # fmt: skip


def cluster(trials: int, per_host: int = 1, strategy: str = "ddp") -> dict:
    """``trials`` runs of the trial; the medians of its seconds, the worst of its steps lost.
    ``per_host`` processes per host (2: worlds 6 and 4, a global batch of 24 kept)."""
    from cluster import replicas
    from cluster.required import require_cluster  # noqa: F401  (the same requirements)

    runs = []
    for _ in range(trials):
        with tempfile.TemporaryDirectory(prefix="rw-recovery-cluster-") as folder:
            r = replicas.host_lost(Path(folder), every=1, per_host=per_host, strategy=strategy,
                                   global_batch=12 * per_host)  # fmt: skip
        for key in ("text", "worlds", "steps", "cause_lines"):
            r.pop(key)
        runs.append(r)

    def median(key: str) -> float | None:
        got = [r[key] for r in runs if r[key] is not None]
        return round(statistics.median(got), 2) if len(got) == len(runs) else None

    lost = [r["steps_lost"] for r in runs]
    return {"hosts": 3, "processes_per_host": per_host, "strategy": strategy, "every": 1,
            "trials": trials, "global_batch": 12 * per_host,
            "rdzv_conf": "keep_alive_interval=1,keep_alive_max_attempt=4", "last_call_s": 1,
            "kill_to_training_s": median("kill_to_training_s"),
            "grow_back_s": median("grow_back_s"),
            "steps_lost": None if None in lost else max(lost),
            "hung": any(r["hung"] for r in runs), "runs": runs}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--every", default="1,5,20")
    p.add_argument("--cluster", action="store_true")
    p.add_argument("--trials", type=int, default=3, help="cluster trials (medians reported)")
    p.add_argument("--per-host", type=int, default=1, help="cluster: processes per host")
    p.add_argument("--strategy", default="ddp", help="cluster: ddp or zero1-3")
    p.add_argument("--cluster-only", action="store_true", help="skip the overhead rows")
    p.add_argument("--zero", type=int, default=0, metavar="K",
                   help="only the ZeRO rows: shards against the consolidated state, every K")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.zero:
        result = {"load_before": os.getloadavg(), "cpus": os.cpu_count(),
                  "torch": torch.__version__}  # fmt: skip
        result["zero"] = zero(args.width, args.steps, args.repeats, args.zero)
        result["load_after"] = os.getloadavg()
        emit(result, args.out)
        return
    if args.cluster_only:  # one cluster configuration alone (e.g. 2 processes per host)
        result = {"load_before": os.getloadavg(), "cpus": os.cpu_count(),
                  "torch": torch.__version__}  # fmt: skip
        result["cluster"] = cluster(args.trials, args.per_host, args.strategy)
        result["load_after"] = os.getloadavg()
        emit(result, args.out)
        return
    everys = [k if k == "auto" else int(k) for k in args.every.split(",")]  # auto: the default
    result = {"load_before": os.getloadavg(), "cpus": os.cpu_count(),
              "torch": torch.__version__}  # fmt: skip
    result["overhead"] = overhead(args.width, args.steps, args.repeats, everys)
    if args.cluster:
        result["cluster"] = cluster(args.trials, args.per_host, args.strategy)
    result["load_after"] = os.getloadavg()
    o, c = result["overhead"], result.get("cluster", {})
    result["summary"] = {  # the keys the goodput model reads
        "kill_to_training_s": c.get("kill_to_training_s"),
        "steps_lost": c.get("steps_lost"),
        "grow_back_s": c.get("grow_back_s"),
        "replication_overhead_pct": o["replication_overhead_pct"],
        "state_bytes_per_rank": o["state_bytes_per_rank"],
        "world": o["world"],
        "hosts": c.get("hosts"),
        "load": [result["load_before"], result["load_after"]],
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
