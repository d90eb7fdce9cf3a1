"""What checking every record's CRC-32 costs when a checkpoint loads.

    flock /tmp/bench.lock python benchmarks/checkpoint_verify.py --gb 1 --repeats 3

Saves a checkpoint of about ``--gb`` GB (a model of 64 MiB float32 layers, through
``rw.save_checkpoint``), then loads it ``--repeats`` times each way, interleaved, from the page
cache: ``plain`` is ``torch.load(weights_only=True)``; ``verified`` is ``rw.load_checkpoint``'s
read (the same load while ``checkpoint_verify.Verifier`` recomputes every record's CRC-32 in
threads). Reports the medians and the overhead in percent of the plain load (the goal: at most
10%). ``crc_only_s`` is the CRC pass alone, for scale. Prints JSON; ``--out`` writes it too.
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import emit

import rankwise as rw
from rankwise import checkpoint, checkpoint_verify

LAYER = 4096  # a 4096 x 4096 float32 weight: 64 MiB


def _model(gb: float) -> nn.Module:
    layers = max(1, round(gb * 2**30 / (LAYER * LAYER * 4)))
    return nn.Sequential(*[nn.Linear(LAYER, LAYER, bias=False) for _ in range(layers)])


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (a temp dir)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = rw.save_checkpoint(Path(folder) / "big.pt", model=_model(args.gb))
        size = path.stat().st_size
        records = len(checkpoint_verify.records(path))
        cpu = torch.device("cpu")
        torch.load(path, weights_only=True)  # warm the page cache
        plain, verified, crc = [], [], []
        for _ in range(args.repeats):
            plain.append(_time(lambda: torch.load(path, map_location=cpu, weights_only=True)))
            verified.append(_time(lambda: checkpoint._read(path, cpu, trusted=False)))
            crc.append(_time(lambda: checkpoint_verify.Verifier(path).check()))
    p, v = statistics.median(plain), statistics.median(verified)
    emit(
        {
            "benchmark": "checkpoint_verify",
            "file_gb": round(size / 1e9, 3),
            "records": records,
            "threads": min(8, os.cpu_count() or 1),
            "plain_load_s": round(p, 3),
            "verified_load_s": round(v, 3),
            "crc_only_s": round(statistics.median(crc), 3),
            "overhead_pct": round(100 * (v - p) / p, 1),
            "runs": {"plain": plain, "verified": verified, "crc_only": crc},
        },
        args.out,
    )


if __name__ == "__main__":
    main()
