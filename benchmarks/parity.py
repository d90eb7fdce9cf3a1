"""torch's own DistributedDataParallel tests, run against torch's DDP and against rankwise's.

    flock /tmp/bench.lock python benchmarks/parity.py --out benchmarks/results/parity.json
    python benchmarks/parity.py --only 'no_sync|create_graph' --impl rankwise   # a subset
    python benchmarks/parity.py --torch-tests ~/pytorch/test/distributed    # + the c10d files

The tests are torch's (``torch/testing/_internal/distributed/distributed_test.py``, installed
with torch), selected as every test whose body constructs a ``DistributedDataParallel``. They
run exactly as torch's CI runs them (``test_distributed_spawn.py``: one spawned process per
rank, Gloo, world size 2), once as they are and once with ``DistributedDataParallel`` replaced
by ``rankwise.DistributedDataParallel`` everywhere the tests can reach it. Tests that read
torch's internals no other engine can offer would be listed in ``INTERNALS`` with the reason
(docs/ddp.md too).

``--torch-tests DIR`` also runs ``DistributedDataParallelTest`` of ``test_c10d_gloo.py`` and the
``CommonDistributedDataParallelTest`` it inherits from ``test_c10d_common.py``, read from DIR (a
pytorch checkout's ``test/distributed/``; the files are not in the wheel and are never copied
here), ported to the CPU by the transform ``benchmarks/_c10d_port.py`` documents. Counts are
reported per file.

Needs `pip install expecttest` (the `parity` extra). On demand only (it spawns two processes
per test, twice: several minutes); not part of the
default pytest run. Prints JSON and writes ``--out``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

from _report import emit

ROOT = Path(__file__).resolve().parents[1]
IMPL = os.environ.get("RANKWISE_PARITY_IMPL", "")
TORCH_DIR = os.environ.get("RANKWISE_PARITY_TORCH_DIR", "")  # set: run the c10d files
DT = "distributed_test.py"

INTERNALS: dict[str, str] = {}
"""Tests that read torch's internals no other engine can offer, with the reason (none now: the
two that read the DDP logging record pass since ``_get_ddp_logging_data()`` exists)."""

if IMPL:  # set in this process and, through the environment, in the ranks it spawns
    os.environ.setdefault("BACKEND", "gloo")
    os.environ.setdefault("WORLD_SIZE", "2")
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="rankwise-parity-"))
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    if IMPL == "rankwise":
        import rankwise

        torch.nn.parallel.DistributedDataParallel = rankwise.DistributedDataParallel
    from torch.testing._internal.distributed import distributed_test as dt

    if IMPL == "rankwise":
        dt.DistributedDataParallel = rankwise.DistributedDataParallel

    class TestDistBackendWithSpawn(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        """torch's test_distributed_spawn.py, verbatim in spirit: one process per rank."""

        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()

    if TORCH_DIR:  # also in every spawned rank, before it unpickles its test class
        import _c10d_port

        C10D = _c10d_port.load(TORCH_DIR, torch.nn.parallel.DistributedDataParallel)


def _source(name: str) -> str:
    try:
        return inspect.getsource(inspect.unwrap(getattr(dt.DistributedTest._DistTestBase, name)))
    except (AttributeError, OSError, TypeError):
        return ""


def ddp_tests() -> list[str]:
    """torch's tests that construct a DistributedDataParallel, directly or in a helper."""
    base = dt.DistributedTest._DistTestBase
    builds: dict[str, bool] = {}

    def reaches(name: str, seen: frozenset = frozenset()) -> bool:
        if name not in builds:
            src = _source(name)
            helpers = set(re.findall(r"self\.(_\w+)\(", src)) - seen
            builds[name] = "DistributedDataParallel(" in src or any(
                reaches(h, seen | {name}) for h in helpers if hasattr(base, h)
            )
        return builds[name]

    return [n for n in sorted(dir(base)) if n.startswith("test_") and reaches(n)]


GPU_ONLY = re.compile(r"@(skip_if_lt_x_gpu|skip_if_no_gpu|require_n_gpus_for_nccl_backend)\b")


def _needs_gpu(name: str) -> bool:
    """Decorated to skip without GPUs: recorded as skipped without spawning two ranks."""
    import torch

    head = _source(name).split("def ", 1)[0]
    return torch.cuda.device_count() == 0 and bool(GPU_ONLY.search(head))


def _suites() -> dict[str, list[tuple[str, type]]]:
    """{file: [(test name, the class that runs it)]}."""
    if not TORCH_DIR:
        return {DT: [(n, TestDistBackendWithSpawn) for n in ddp_tests()]}
    runner = C10D["test_c10d_gloo.py"]
    return {f: [(n, runner) for n in names] for f, names in _c10d_port.tests_of(TORCH_DIR, runner).items()}


def _child(only: str | None) -> dict:
    """Run the selected tests in this process (which spawns the ranks); outcome per file, test."""
    return {
        file: _run_tests([(n, cls) for n, cls in tests if only is None or re.search(only, n)])
        for file, tests in _suites().items()
    }


def _run_tests(tests: list[tuple[str, type]]) -> dict[str, str]:
    outcome: dict[str, str] = {}
    for name, cls in tests:
        if cls is TestDistBackendWithSpawn and _needs_gpu(name):
            outcome[name] = "skipped: needs GPUs (decorator; not spawned)"
            continue
        result = unittest.TestResult()
        start = time.perf_counter()
        cls(name).run(result)
        if result.skipped:
            status = "skipped: " + result.skipped[0][1].splitlines()[0][:120]
        elif result.errors or result.failures:
            tb = (result.errors + result.failures)[0][1]
            lines = [ln.strip() for ln in tb.splitlines() if ln.strip()]
            errors = [ln for ln in lines if re.search(r"(Error|Exception)\b", ln)]
            status = "failed: " + (errors or lines)[-1][:300]
        else:
            status = "passed"
        outcome[name] = status
        print(f"{IMPL:8s} {name}: {status} ({time.perf_counter() - start:.1f}s)", flush=True)
    return outcome


def _run(impl: str, only: str | None, torch_dir: str = "") -> dict:
    env = {**os.environ, "RANKWISE_PARITY_IMPL": impl, "OMP_NUM_THREADS": "1"}
    env["RANKWISE_PARITY_TORCH_DIR"] = torch_dir
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "--child"] + (["--only", only] if only else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    sys.stderr.write(proc.stderr[-3000:] if proc.returncode else "")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise SystemExit(f"{impl} run produced no result (exit {proc.returncode})")
    return json.loads(lines[-1])


def _counts(res: dict[str, str]) -> dict[str, int]:
    return {
        "passed": sum(s == "passed" for s in res.values()),
        "skipped": sum(s.startswith("skipped") for s in res.values()),
        "failed": sum(s.startswith("failed") for s in res.values()),
    }


def _report(runs: dict[str, dict[str, dict[str, str]]], file: str) -> dict:
    """One file's figures: counts per engine, and how many torch's passes ours passes too."""
    impls = list(runs)
    names = sorted(next(iter(runs.values()))[file])
    out: dict = {
        "tests_building_ddp": len(names),
        "counts": {impl: _counts(runs[impl][file]) for impl in impls},
        "tests": {n: {impl: runs[impl][file][n] for impl in impls} for n in names},
    }
    if "torch" in runs and "rankwise" in runs:
        torch_pass = [n for n in names if runs["torch"][file][n] == "passed"]
        out["pass_with_torch"] = len(torch_pass)
        out["of_those_pass_with_rankwise"] = sum(
            runs["rankwise"][file][n] == "passed" for n in torch_pass
        )
        out["not_passing_with_rankwise"] = sorted(
            n for n in torch_pass if runs["rankwise"][file][n] != "passed"
        )
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="regular expression selecting test names")
    parser.add_argument("--impl", choices=["torch", "rankwise", "both"], default="both")
    parser.add_argument(
        "--torch-tests",
        metavar="DIR",
        help="a pytorch checkout's test/distributed/: also run test_c10d_gloo.py's and "
        "test_c10d_common.py's DDP tests from there (CPU port: benchmarks/_c10d_port.py)",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.only)))
        return {}
    impls = ["torch", "rankwise"] if args.impl == "both" else [args.impl]
    runs = {impl: _run(impl, args.only) for impl in impls}
    if args.torch_tests:
        torch_dir = str(Path(args.torch_tests).expanduser().resolve())
        for impl in impls:
            runs[impl].update(_run(impl, args.only, torch_dir))
    files = list(next(iter(runs.values())))
    result = {
        "benchmark": "ddp_parity",
        "backend": "gloo",
        "world_size": 2,
        "torch_tests_dir": args.torch_tests,
        "internals_read": INTERNALS,
        "files": {file: _report(runs, file) for file in files},
    }
    c10d = [f for f in files if f != DT]
    if c10d and len(impls) == 2:
        result["c10d_total"] = {
            key: sum(result["files"][f][key] for f in c10d)
            for key in ("pass_with_torch", "of_those_pass_with_rankwise")
        }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    if "--child" in sys.argv and not IMPL:
        raise SystemExit("--child is internal: run without it")
    main()
