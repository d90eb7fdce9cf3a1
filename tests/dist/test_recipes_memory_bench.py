"""benchmarks/recipes_memory.py runs end to end (the GPT-2 recipe's small model, world 2, one
repeat): every strategy is measured in processes of its own and reports its memory above the
start, and no data-parallel engine holds less than the same training with no communication."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow  # three spawned groups of two ranks
@pytest.mark.timeout(600)
def test_each_strategy_is_measured_alone_and_none_is_below_the_floor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the spawned ranks import it the same way
    bench = importlib.import_module("recipes_memory")
    out = tmp_path / "mem.json"
    result = bench.main(["--quick", "--repeats", "1", "--steps", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    rows, runs = result["rows"], result["runs"]
    assert set(rows) == {"ddp", "torch-ddp", "independent"}
    assert all(len(r) == 1 for r in runs.values()), runs
    floor = rows["independent"]["pss_mb"]
    assert floor > 0, rows  # the model and AdamW's state were counted
    for name in ("ddp", "torch-ddp"):  # gradients' buckets on top of the same training
        assert rows[name]["pss_mb"] >= floor - 1.0, (name, rows)
        assert rows[name]["peak_mb"] >= rows[name]["pss_mb"] - 1.0, (name, rows)
