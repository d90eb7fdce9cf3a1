"""Launch latency: wall time from starting the launcher to the first barrier of 2 processes.

`rankwise run` vs torchrun (`python -m torch.distributed.run`) in the same run, repeats
interleaved (the order alternates) so that machine load hits both alike. Both launch the same
plain-torch worker (init_process_group + barrier), so only the launcher differs. Also reports
the time until the launcher has exited. Prints JSON; --out also writes it to a file.

    flock /tmp/rankwise-bench.lock python benchmarks/launch.py --repeats 5 --out launch.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _report import emit

WORKER = textwrap.dedent("""
    import os, sys, time
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            f.write(repr(time.time()))
    dist.destroy_process_group()
""")

SRC = str(Path(__file__).resolve().parents[1] / "src")

LAUNCHERS = {
    "rankwise": [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"],
}


def once(name: str, script: Path, folder: Path) -> dict[str, float]:
    stamp = folder / f"{name}.barrier"
    stamp.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    start = time.time()
    subprocess.run([*LAUNCHERS[name], str(script), str(stamp)], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)  # fmt: skip
    end = time.time()
    return {"to_barrier_s": float(stamp.read_text()) - start, "to_exit_s": end - start}


def summary(samples: list[dict[str, float]]) -> dict:
    out = {}
    for key in ("to_barrier_s", "to_exit_s"):
        values = [s[key] for s in samples]
        out[key] = {
            "median": round(statistics.median(values), 3),
            "mean": round(statistics.mean(values), 3),
            "min": round(min(values), 3),
            "all": [round(v, 3) for v in values],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    samples: dict[str, list] = {name: [] for name in LAUNCHERS}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        script = folder / "worker.py"
        script.write_text(WORKER)
        once("rankwise", script, folder)  # warm the file cache for both (not counted)
        once("torchrun", script, folder)
        for i in range(args.repeats):
            order = list(LAUNCHERS) if i % 2 == 0 else list(reversed(LAUNCHERS))
            for name in order:
                samples[name].append(once(name, script, folder))
    result = {
        "benchmark": "launch: start -> first barrier, 2 processes, gloo, CPU",
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        **{name: summary(s) for name, s in samples.items()},
    }
    for key in ("to_barrier_s", "to_exit_s"):
        result[f"ratio_{key}_median"] = round(
            result["rankwise"][key]["median"] / result["torchrun"][key]["median"], 3
        )
    emit(result, args.out)


if __name__ == "__main__":
    main()
