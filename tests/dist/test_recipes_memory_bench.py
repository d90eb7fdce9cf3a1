"""benchmarks/recipes_memory.py runs end to end (the GPT-2 recipe's small model, world 2, one
repeat): every strategy is measured in processes of its own and reports its memory above the
start, and no data-parallel engine's resident peak is below the same training's with no
communication."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.slow  # three spawned groups of two ranks
@pytest.mark.timeout(600)
def test_each_strategy_is_measured_alone_and_none_is_below_the_floor(
    tmp_path: Path, import_benchmark
) -> None:
    bench = import_benchmark("recipes_memory")
    out = tmp_path / "mem.json"
    result = bench.main(["--quick", "--repeats", "1", "--steps", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    rows, runs = result["rows"], result["runs"]
    assert set(rows) == {"ddp", "torch-ddp", "independent"}
    assert all(len(r) == 1 for r in runs.values()), runs
    # The resident high-water mark counts every page a rank touched, whoever else maps it: a
    # data-parallel engine holds its buckets on top of the same training. (The proportional
    # set splits shared pages, the libraries' too, among every process mapping them, so it
    # moves with whatever else runs: compared only between runs of one quiet benchmark.)
    floor = rows["independent"]["peak_mb"]
    assert floor > 0 and rows["independent"]["pss_mb"] > 0, rows
    for name in ("ddp", "torch-ddp"):
        assert rows[name]["peak_mb"] >= floor - 2.0, (name, rows)
