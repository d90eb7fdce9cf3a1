"""Goodput through failures at 1k-16k devices: restart from disk, in-memory recovery and
shrink-and-continue, from the Llama 3 failure rate and this project's measured recovery costs.

    python benchmarks/goodput.py [--measure] [--trials N] [--mc-trials N] [--out FILE]

``--measure`` (root: a namespace cluster) first times a restart from disk on 3 hosts x 1
process (benchmarks/_goodput_cluster.py), each killed run beside an unkilled one with the same
checkpoint interval, into benchmarks/results/goodput_cluster.json; without it, that file is
read. Then:

- ``validation``: each killed run predicted by the model (``replay``, a restart from disk)
  from the checkpoint interval, the kill's step, and the phase costs of the *other* killed
  runs (leave one out): steps lost, seconds from the kill to training again, seconds lost
  against the unkilled run, goodput; each with ``within_20pct``.
- ``sweeps``: goodput of the three policies, closed form and seeded Monte Carlo (54-day runs),
  as the job size, checkpoint size, storage bandwidth, checkpoint interval, replication
  interval and replacement time vary; the disk policy at Daly's interval unless swept.
- ``intervals``: Young's and Daly's optimum against the best interval the model finds.
- ``inputs``: every number the sweeps used and where it comes from. The in-memory costs come
  from benchmarks/results/recovery.json when it exists (``in_memory_source``), otherwise from
  the stated assumptions (the issue's targets).

Writes benchmarks/results/goodput.json and docs/img/goodput.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))  # this checkout's rankwise, not an installed one
RESULTS = HERE / "results"
CLUSTER_JSON = RESULTS / "goodput_cluster.json"
RECOVERY_JSON = RESULTS / "recovery.json"  # the in-memory recovery's record, when it exists
PLOT = HERE.parent / "docs" / "img" / "goodput.png"
# (save every K steps, kill after step S): 9, 3 and 19 steps of work lost.
CONFIGS = ((10, 29), (5, 33), (20, 39))
STEPS, SLEEP = 53, 0.2


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def measure(trials: int) -> dict:
    """Every config ``trials`` times: an unkilled run, then a killed one."""
    import _goodput_cluster as cluster

    runs, loads, began = [], [_load()], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rw-goodput-") as tmp:
        for i in range(trials):
            for save_every, kill_at in CONFIGS:
                pair = {}
                for name, kill in (("unkilled", None), ("killed", kill_at)):
                    folder = Path(tmp) / f"{i}-{save_every}-{name}"
                    pair[name] = cluster.run(folder, steps=STEPS, save_every=save_every,
                                             sleep=SLEEP, kill_at=kill)  # fmt: skip
                    loads.append(_load())
                    print(json.dumps({name: pair[name]}), file=sys.stderr)
                runs.append(pair)
    return {
        "setup": f"{cluster.NODES} hosts x 1 process, rankwise run --nnodes 2:3 --max-restarts 1"
                 " (c10d); the killed host replaced at once; a step is a tiny DDP step plus a "
                 f"{SLEEP} s sleep",
        "runs": runs,
        "load": {"cores": os.cpu_count(), "loadavg": loads, "busy_machine": True},
        "wall_s": round(time.monotonic() - began, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measure", action="store_true", help="time the cluster runs first (root)")
    p.add_argument("--trials", type=int, default=1, help="cluster runs per config")
    p.add_argument("--mc-trials", type=int, default=40, help="Monte Carlo runs per point")
    p.add_argument("--out", type=Path, default=RESULTS / "goodput.json")
    p.add_argument("--plot", type=Path, default=PLOT)
    p.add_argument("--recovery", type=Path, default=RECOVERY_JSON,
                   help="the in-memory recovery's record (used when the file exists)")
    a = p.parse_args()
    if a.measure:
        CLUSTER_JSON.write_text(json.dumps(measure(a.trials), indent=1) + "\n")
    import _goodput_model as model

    cluster = json.loads(CLUSTER_JSON.read_text())
    recovery = json.loads(a.recovery.read_text()) if a.recovery.exists() else None
    result = model.report(cluster, recovery, mc_trials=a.mc_trials, load=_load())
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    model.plot(result, a.plot)
    print(json.dumps(result["validation"], indent=1))
    print(f"in-memory costs: {result['inputs']['in_memory_source']}")
    print(f"wrote {a.out} and {a.plot}")


if __name__ == "__main__":
    main()
