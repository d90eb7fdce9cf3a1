"""benchmarks/ddp_wait.py: its skew, tail and wait are what its docstring says, and it runs.

docs/ddp.md explains the DDP row's distance from the synchronous ceiling with these figures,
so the derivation is checked on times worked out by hand, and a tiny run checks that every
kind and loop order comes back with figures that hold together (no timing is asserted).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def test_skew_tail_and_wait_from_two_ranks_times(import_benchmark) -> None:
    bench = import_benchmark("ddp_wait")
    # (start, ready, done, end) in ms; rank 1 finishes its compute 3 ms after rank 0 in
    # step 0 and 1 ms before it in step 1; the last backward returns 2 ms after the later one.
    t = torch.tensor(
        [
            [[0.0, 10.0, 15.0, 20.0], [20.0, 31.0, 33.0, 40.0]],
            [[0.0, 13.0, 15.0, 21.0], [20.0, 30.0, 33.5, 39.0]],
        ],
        dtype=torch.float64,
    )
    got = bench._derive(t)
    # skew: 3 and 1; tail: 15-13=2 and 33.5-31=2.5; wait: mean(5, 2)=3.5 and mean(2, 3.5)=2.75
    assert got["skew_ms"] == pytest.approx(2.0)
    assert got["tail_ms"] == pytest.approx(2.25)
    assert got["wait_ms"] == pytest.approx(3.125)
    assert got["step_ms"] == pytest.approx(20.5)  # 21 and 20
    assert got["compute_ms"] == pytest.approx(11.0)  # mean(10, 13)=11.5, mean(11, 10)=10.5


def test_a_tiny_run_reports_every_kind_and_order(import_benchmark, tmp_path: Path) -> None:
    bench = import_benchmark("ddp_wait")
    out = tmp_path / "wait.json"
    result = bench.main(["--batch", "4", "--steps", "2", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    orders = {f"{o}/{'none' if n else 'zero'}" for o, n in bench.ORDERS}
    assert set(result["rows"]) == {f"{k}/{o}" for k in bench.KINDS for o in orders}
    for label, row in result["rows"].items():
        assert row["skew_ms"] >= 0 and row["tail_ms"] >= 0 and row["wait_ms"] >= 0, label
        assert row["step_ms"] >= row["compute_ms"] > 0, label
    assert set(result["step_over_torch"]) == orders
