"""What verifying a checkpoint costs when it loads, and what each checksum pass costs alone.

    flock /tmp/bench.lock python benchmarks/checkpoint_verify.py --gb 1 --repeats 7 \
        --out benchmarks/results/checkpoint_verify.json

Saves a checkpoint of about ``--gb`` GB (a model of 64 MiB float32 layers, through
``rw.save_checkpoint``), then loads it ``--repeats`` times each way, interleaved, from the page
cache: ``plain`` is ``torch.load(weights_only=True)``; ``verified`` is ``rw.load_checkpoint``'s
read (the same load while ``checkpoint_verify.Verifier`` checks the zip structure and every
record against the XXH3 digests ``save_checkpoint`` wrote into the file, in threads). Reports
the medians and the overhead in percent of the plain load (the goal: at most 3%).

For the choice of the digest, each pass alone over the same file, in the same threads:
``verify_only_s`` (the whole ``Verifier``: structure + XXH3-64), ``xxh3_only_s``, ``crc32c_only_s``
(CRC-32C with the ``crc32c`` or ``google-crc32c`` package, when one is installed; null
otherwise) and ``crc_only_s`` (zlib's CRC-32, what files without digests, e.g. plain
``torch.save`` files, are checked with). Prints JSON; ``--out`` writes it too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import emit

import rankwise as rw
from rankwise.checkpoint import single as checkpoint
from rankwise.checkpoint import sums as checkpoint_sums
from rankwise.checkpoint import verify as checkpoint_verify

LAYER = 4096  # a 4096 x 4096 float32 weight: 64 MiB


def _model(gb: float) -> nn.Module:
    layers = max(1, round(gb * 2**30 / (LAYER * LAYER * 4)))
    return nn.Sequential(*[nn.Linear(LAYER, LAYER, bias=False) for _ in range(layers)])


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _crc32c() -> Callable[[memoryview, int, int], int] | None:
    """CRC-32C of a range, from whichever CRC-32C package is installed (None: neither)."""
    try:
        import crc32c

        return lambda view, a, b: crc32c.crc32c(view[a:b])
    except ImportError:
        pass
    try:
        import google_crc32c

        return lambda view, a, b: google_crc32c.value(bytes(view[a:b]))  # wants bytes
    except ImportError:
        return None


def _pass(path: Path, fn: Callable[[memoryview, int, int], int]) -> None:
    """``fn`` over every record's 64 MiB pieces in threads, as ``Verifier`` schedules them."""
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            jobs = [
                pool.submit(fn, view, a, b)
                for r in checkpoint_verify.records(path)
                for a, b in checkpoint_verify._pieces(r)
            ]
            for job in jobs:
                job.result()
        view.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (a temp dir)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = rw.save_checkpoint(Path(folder) / "big.pt", model=_model(args.gb))
        size = path.stat().st_size
        records = len(checkpoint_verify.records(path))
        cpu = torch.device("cpu")
        torch.load(path, weights_only=True)  # warm the page cache
        crc32c = _crc32c()
        passes: dict[str, Callable[[], None]] = {
            "verify_only": lambda: checkpoint_verify.Verifier(path).check(),
            "xxh3_only": lambda: _pass(path, checkpoint_sums.piece_digest),
            "crc_only": lambda: _pass(path, checkpoint_verify._crc_piece),
        }
        if crc32c is not None:
            passes["crc32c_only"] = lambda: _pass(path, crc32c)
        runs: dict[str, list[float]] = {k: [] for k in ["plain", "verified", *passes]}
        for _ in range(args.repeats):
            runs["plain"].append(
                _time(lambda: torch.load(path, map_location=cpu, weights_only=True))
            )
            runs["verified"].append(_time(lambda: checkpoint._read(path, cpu, trusted=False)))
            for name, fn in passes.items():
                runs[name].append(_time(fn))
    p, v = statistics.median(runs["plain"]), statistics.median(runs["verified"])
    medians = {f"{k}_s": round(statistics.median(x), 3) for k, x in runs.items()}
    emit(
        {
            "benchmark": "checkpoint_verify",
            "file_gb": round(size / 1e9, 3),
            "records": records,
            "threads": min(8, os.cpu_count() or 1),
            "digest": checkpoint_sums.ALGORITHM,
            "plain_load_s": medians.pop("plain_s"),
            "verified_load_s": medians.pop("verified_s"),
            "overhead_pct": round(100 * (v - p) / p, 1),
            "crc32c_only_s": None,
            **medians,
            "runs": runs,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
