"""benchmarks/gpu_bench.py runs end to end on the CPU (--dry-run), so a GPU session can trust it.

The figures of a dry run mean nothing; what is checked is that every part runs and the JSON
has the fields benchmarks/gpu_check.sh and the notes rely on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_dry_run_measures_every_part_and_writes_the_json(
    tmp_path: Path, import_benchmark
) -> None:
    bench = import_benchmark("gpu_bench")
    out = tmp_path / "gpu.json"
    result = bench.main(["--dry-run", "--out", str(out), "--tests-rc", "0", "--timeout", "120"])
    assert json.loads(out.read_text()) == result
    assert result["dry_run"] is True and result["gpu_tests_exit_code"] == 0
    parts = {
        "ddp_world1_nccl": {"rankwise", "rankwise_allreduce", "torch", "bare"},
        "ddp_world2_gloo_one_gpu": {"rankwise", "torch"},
        "dp_one_device": {"rankwise", "torch", "bare", "rankwise_two_replicas"},
    }
    for part, kinds in parts.items():
        ms = result[part]["step_ms"]
        assert set(ms) == kinds and all(v > 0 for v in ms.values()), (part, ms)
        assert result[part]["ratios"]["rankwise_over_torch"] > 0
    assert set(result["meets_targets"]) == set(result["targets"])


def test_bad_arguments_are_refused_with_the_value(
    capsys: pytest.CaptureFixture, import_benchmark
) -> None:
    bench = import_benchmark("gpu_bench")
    with pytest.raises(SystemExit):
        bench.parse(["--steps", "0"])
    assert "--steps must be at least 1, got 0" in capsys.readouterr().err
