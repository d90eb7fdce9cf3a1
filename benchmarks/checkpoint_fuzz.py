"""The checkpoint byte fuzz, whole: every file of a sharded checkpoint and of a single-file one.

    flock /tmp/rw-bench.lock python benchmarks/checkpoint_fuzz.py \
        --out benchmarks/results/checkpoint_fuzz.json

Saves one state (a tiny model, SGD with momentum, a StepLR, step 42, epoch 3, an ``extra``
value) three ways: ``rw.save_checkpoint(..., sharded=True)`` (a folder: ``__0_0.distcp``,
``.metadata``, ``rankwise.json``), ``rw.save_checkpoint`` to one file, and torch's ``dcp.save``
(a plain DCP folder, no ``rankwise.json``). Then changes one byte at a time, loads, puts the byte
back, and counts each outcome per file (``_ckpt_fuzz`` says what is tried of each file, what
"load" means and the outcome classes). The goal: 0 ``silent``, 0 ``raw``, 0 ``hang``.

``--sample N`` tries N positions per file (seeded) instead of all: a smoke run. Prints JSON
(``--out`` writes it too) with the counts per file and class, the totals, the first failures,
the duration and the machine's load average before and after (this machine is shared: the
duration is not a speed figure).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _ckpt_fuzz as fuzz
from _report import emit


def _commit() -> str | None:
    """The checkout's commit (``+changes`` when the tree differs from it), or None."""
    import subprocess

    here = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "src",
                                "benchmarks"], capture_output=True, text=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=None, help="positions per file (default all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per trial (a hang)")
    parser.add_argument("--kinds", default="sharded,single,plain-dcp",
                        help="which checkpoints (comma-separated; default all three)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch

    load_before = os.getloadavg()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        kinds = {k: p for k, p in fuzz.make_checkpoints(root / "checkpoints").items()
                 if k in args.kinds.split(",")}  # fmt: skip
        (root / "scratch").mkdir()
        sizes = {f"{k}/{f.name}": f.stat().st_size for k, p in kinds.items()
                 for f in fuzz.files_of(k, p)}  # fmt: skip

        def progress(report: fuzz.Report) -> None:
            print(f"  {report.tries} trials, {time.monotonic() - start:.0f} s", file=sys.stderr)

        report = fuzz.run(kinds, root / "scratch", sample=args.sample, seed=args.seed,
                          timeout=args.timeout, progress=progress)  # fmt: skip
    totals = {c: report.total(c) for c in fuzz.CLASSES}
    return emit({
        "benchmark": "checkpoint_fuzz",
        "what": "one byte of one file changed at a time (every bit of rankwise.json; every byte "
                "of .metadata xor 0x01 and xor 0xFF; the other files every byte xor 0x01, every "
                f"second byte past {fuzz.SMALL} bytes), then loaded; counts per file and outcome",
        "sample_per_file": args.sample,
        "kinds": sorted(kinds),
        "file_bytes": sizes,
        "counts": report.counts,
        "totals": totals,
        "trials": report.tries,
        "failures": totals["silent"] + totals["raw"] + totals["hang"],
        "first_failures": report.failures[:20],
        "trial_timeout_s": args.timeout,
        "duration_s": round(time.monotonic() - start, 1),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "torch": str(torch.__version__),
        "commit": _commit(),
        "note": "plain-dcp: only .metadata is changed (DCP stores no checksum of a tensor's "
                "bytes: a change there loads undetected). The machine is shared with other "
                "jobs: the duration is not a speed figure.",
    }, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
