"""Step time across a slow link: torch DDP, rankwise flat, rankwise hierarchical, in one run.

    sudo flock /tmp/rankwise-bench.lock python benchmarks/hierarchical.py \
        --out benchmarks/results/hierarchical.json

Two nodes x two processes (``--per-node``) in network namespaces (``_twonodes.py``: each node
its own address and its own /dev/shm), the link between them shaped on both ends to
``--rate 1gbit`` and ``--delay 0.5ms`` (netem; where the kernel has no netem, a token bucket at
the rate and no delay, and the JSON says so). ``rankwise run --nnodes 2 --node-rank i`` starts
each node's ranks, as on two machines. The reference MLP (``rankwise.bench.models.mlp``, 10.5M
parameters, 42 MB of gradients) trains with SGD, the same batches in every configuration:

- ``torch_ddp``: torch's DistributedDataParallel (Gloo's flat all-reduce over 4 ranks);
  ``torch_ddp_view``: the same with ``gradient_as_bucket_view=True`` (torch's best setting
  here); ``torch_ddp_hier_hook``: that, with a hierarchical communication hook
  (``_hier_worker.HierarchicalHook``: a sum within the node, an all-reduce between one rank
  per node, a broadcast within the node, on a worker thread so backward goes on);
- ``rankwise_flat``: rankwise DDP with ``hierarchical_reduce=False``, today's path across
  nodes (each node's /dev/shm is its own, so the shared-memory file cannot be agreed on and
  every bucket goes through Gloo's all-reduce);
- ``rankwise_hierarchical``: rankwise DDP as it comes (chosen because the job spans nodes);
- ``independent``: every rank trains alone, no communication (the compute term).

Interleaved: each repeat runs every configuration once, in an order rotated by one, after two
warm-up steps each; a configuration's time in a repeat is the slowest rank's mean over
``--steps`` steps; the table holds the median over ``--repeats``. Also measured in the run: an
all-reduce sweep between one rank per node (the link's latency and bandwidth, fitted as
``rankwise bench`` fits its own) and one thread's memcpy bandwidth. The projection of
``rankwise.bench.network.projection`` (ring model for the flat rows, ``hierarchical_allreduce_s`` for
the hierarchical one) is compared with the measured steps, once with the measured link and once
with the nominal one (``--rate``/``--delay``). After the timing, every configuration has taken
the same steps on the same batches from the same initial model: their parameters are compared
(max abs difference) and each one's bit-identity across the four ranks is checked.

The projection's error is reported on the whole step and on communication alone (the step
less the ``independent`` step: the compute term is measured in the same run, so an error on
the whole step understates the model's). The ceiling is printed beside the ratios: the
``independent`` step over torch's best, and the gradient bytes over the fitted link bandwidth.

Targets (issue 47): ``rankwise_hierarchical`` step <= 0.65x the best of torch's three; the
projection of communication within 15%. Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from _report import emit  # noqa: E402
from _twonodes import TwoNodes, Unavailable, unavailable  # noqa: E402


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="1gbit", help="link rate, tc syntax (default 1gbit)")
    p.add_argument("--delay", default="0.5ms", help="link delay per direction (default 0.5ms)")
    p.add_argument("--per-node", type=int, default=2, help="processes per node (default 2)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole job")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a rank: write JSON here
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = _args(argv)
    if args.worker:
        from _hier_worker import run_rank

        run_rank(args)
        return {}
    reason = unavailable()
    if reason:
        return emit({"skipped": reason}, args.out)
    load = os.getloadavg()[0]
    try:
        measured, shaping = _run_job(args)
    except Unavailable as exc:
        return emit({"skipped": str(exc)}, args.out)
    from _hier_worker import summarise

    result = summarise(measured, shaping, args)
    result["machine"] = {"cpus": os.cpu_count(),
                         "loadavg_1m_before_after": [round(load, 2), round(os.getloadavg()[0], 2)]}  # fmt: skip
    return emit(result, args.out)


def _run_job(args: argparse.Namespace) -> tuple[dict, dict]:
    """Start both nodes' launchers, wait, return rank 0's measurements and the shaping."""
    with TwoNodes() as nodes, tempfile.TemporaryDirectory(prefix="rwh-") as tmp:
        shaping = nodes.shape(args.rate, args.delay)
        result = Path(tmp) / "rank0.json"
        env = {**os.environ, "PYTHONPATH": f"{HERE.parent / 'src'}:{os.environ.get('PYTHONPATH', '')}",
               "OMP_NUM_THREADS": "1", "TMPDIR": tmp}  # fmt: skip
        passed = [f"--{k}={getattr(args, k.replace('-', '_'))}"
                  for k in ("per-node", "batch", "steps", "repeats")]  # fmt: skip
        procs = []
        for i in (1, 0):
            argv = [sys.executable, "-m", "rankwise", "run", "--nnodes", "2", "--nproc-per-node",
                    str(args.per_node), "--node-rank", str(i), "--master-addr", nodes.addr[0],
                    "--master-port", "29533", "--rdzv-timeout", "120", str(Path(__file__)),
                    *passed, f"--worker={result}"]  # fmt: skip
            log = open(Path(tmp) / f"node{i}.log", "w")  # noqa: SIM115 (closed below)
            procs.append((i, log, subprocess.Popen([*nodes.prefix(i), *argv], env=env,
                                                   stdout=log, stderr=subprocess.STDOUT)))  # fmt: skip
        deadline = time.monotonic() + args.timeout
        codes = {}
        for i, log, proc in procs:
            try:
                codes[i] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[i] = "timeout"
            log.close()
        if any(c != 0 for c in codes.values()) or not result.exists():
            tails = {i: (Path(tmp) / f"node{i}.log").read_text()[-3000:] for i in (0, 1)}
            raise RuntimeError(f"the two-node job failed: exit codes {codes}\n"
                               + "\n".join(f"--- node {i}:\n{t}" for i, t in tails.items()))  # fmt: skip
        return json.loads(result.read_text()), shaping


if __name__ == "__main__":
    main()
