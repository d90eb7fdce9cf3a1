"""What checking every record's checksum costs when a checkpoint loads.

    flock /tmp/bench.lock python benchmarks/checkpoint_verify.py --gb 1 --repeats 3

Saves a checkpoint of about ``--gb`` GB (a model of 64 MiB float32 layers, through
``rw.save_checkpoint``), then loads it ``--repeats`` times each way, interleaved, from the page
cache: ``plain`` is ``torch.load(weights_only=True)``; ``verified`` is ``rw.load_checkpoint``'s
read (the same load while ``checkpoint_verify.Verifier`` checks every record against the
checksums ``save_checkpoint`` wrote into the file, in threads). Reports the medians and the
overhead in percent of the plain load (the goal: at most 10%). For scale: ``sum_only_s`` is the
checksum pass alone, ``crc_only_s`` the zip CRC-32 pass alone (what files without the
checksums, e.g. plain ``torch.save`` files, are checked with; it was the only check before).
Prints JSON; ``--out`` writes it too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import emit

import rankwise as rw
from rankwise import checkpoint
from rankwise.checkpoint import verify as checkpoint_verify

LAYER = 4096  # a 4096 x 4096 float32 weight: 64 MiB


def _model(gb: float) -> nn.Module:
    layers = max(1, round(gb * 2**30 / (LAYER * LAYER * 4)))
    return nn.Sequential(*[nn.Linear(LAYER, LAYER, bias=False) for _ in range(layers)])


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _crc_pass(path: Path) -> None:
    """Every record's CRC-32 in threads, as ``Verifier`` checks a file without checksums."""
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            jobs = [
                pool.submit(checkpoint_verify._crc_piece, view, a, b)
                for r in checkpoint_verify.records(path)
                for a, b in checkpoint_verify._pieces(r)
            ]
            for job in jobs:
                job.result()
        view.release()


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
        plain, verified, sums, crc = [], [], [], []
        for _ in range(args.repeats):
            plain.append(_time(lambda: torch.load(path, map_location=cpu, weights_only=True)))
            verified.append(_time(lambda: checkpoint._read(path, cpu, trusted=False)))
            sums.append(_time(lambda: checkpoint_verify.Verifier(path).check()))
            crc.append(_time(lambda: _crc_pass(path)))
    p, v = statistics.median(plain), statistics.median(verified)
    emit(
        {
            "benchmark": "checkpoint_verify",
            "file_gb": round(size / 1e9, 3),
            "records": records,
            "threads": min(8, os.cpu_count() or 1),
            "plain_load_s": round(p, 3),
            "verified_load_s": round(v, 3),
            "sum_only_s": round(statistics.median(sums), 3),
            "crc_only_s": round(statistics.median(crc), 3),
            "overhead_pct": round(100 * (v - p) / p, 1),
            "runs": {"plain": plain, "verified": verified, "sum_only": sums, "crc_only": crc},
        },
        args.out,
    )


if __name__ == "__main__":
    main()
