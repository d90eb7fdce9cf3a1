"""Cost of the debug mode (``rankwise run --debug``: TORCH_DISTRIBUTED_DEBUG=DETAIL).

Two ranks on Gloo, with and without --debug, repeats interleaved: the time of a small
all-reduce (1 Ki float32: latency-bound, the worst case for a per-collective check) and of a
training step of our DDP on a small MLP. Prints JSON; --out also writes it to a file.

    flock /tmp/bench.lock python benchmarks/debug_cost.py --out benchmarks/results/debug_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}

WORKER = textwrap.dedent("""
    import json, sys, time, torch, torch.distributed as dist, rankwise as rw
    from torch import nn
    torch.set_num_threads(1)
    rt = rw.init(timeout=120)
    x = torch.ones(1024)
    for _ in range(20):
        dist.all_reduce(x)
    t = time.perf_counter()
    for _ in range(300):
        dist.all_reduce(x)
    ar = (time.perf_counter() - t) / 300
    torch.manual_seed(0)
    model = rw.DistributedDataParallel(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(32, 256)
    for i in range(60):
        if i == 10:
            t = time.perf_counter()
        model(data).sum().backward()
        opt.step(); opt.zero_grad()
    step = (time.perf_counter() - t) / 50
    if rt.rank == 0:
        open(sys.argv[1], "w").write(json.dumps({"all_reduce_us": ar * 1e6, "ddp_step_ms": step * 1e3}))
""")


def _once(debug: bool, tmp: Path) -> dict:
    out = tmp / f"out-{debug}.json"
    cmd = [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2"]
    cmd += ["--debug"] if debug else []
    subprocess.run([*cmd, "worker.py", str(out)], cwd=tmp, env=ENV, check=True, timeout=300,
                   capture_output=True)  # fmt: skip
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    runs: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="rankwise-debug-cost-") as d:
        tmp = Path(d)
        (tmp / "worker.py").write_text(WORKER)
        for i in range(args.repeats):
            for debug in (False, True) if i % 2 == 0 else (True, False):
                runs[debug].append(_once(debug, tmp))
    result = {}
    for key in ("all_reduce_us", "ddp_step_ms"):
        off = statistics.median(r[key] for r in runs[False])
        on = statistics.median(r[key] for r in runs[True])
        result[key] = {"off": round(off, 1), "debug": round(on, 1), "ratio": round(on / off, 2)}
    result["repeats"] = args.repeats
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
