"""benchmarks/bigmodel.py's smoke mode runs end to end (world 2, a small model), so the full
figures the lead takes on a quiet machine can be trusted to come out.

The figures of a smoke run mean little; what is checked: the JSON has every phase for every
variant (the one-file phases for rankwise only), each checkpoint holds at least the parameters
and AdamW's two moments, and after each load every tensor the optimizer holds equals, byte for
byte, what was saved — with a NaN fill in between that changed every one of them, so a load
that restored nothing would be counted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.slow  # two spawned groups of two ranks: one rankwise variant, one FSDP2 + DCP
@pytest.mark.timeout(1200)
def test_smoke_run_has_every_phase_and_loads_what_it_saved(
    tmp_path: Path, import_benchmark
) -> None:
    bench = import_benchmark("bigmodel")
    out = tmp_path / "bigmodel.json"
    variants = ("rankwise-meta", "fsdp2-meta")  # every variant runs the same phases
    result = bench.main(["--world", "2", "--size", "256", "--layers", "2", "--out", str(out),
                         "--repeats", "1", "--timeout", "600", "--variants", ",".join(variants)])  # fmt: skip
    assert json.loads(out.read_text()) == result
    rows = result["worlds"]["2"]
    assert set(rows) == set(variants)
    for variant, row in rows.items():
        rankwise = variant.startswith("rankwise")
        phases = bench.PHASES + (bench.SINGLE if rankwise else ())
        for phase in phases:
            assert {"peak_mb", "peak_P", "s"} <= set(row[phase]), (variant, phase)
            assert row[phase]["s"] > 0, (variant, phase)
        formats = ("sharded", "single") if rankwise else ("dcp",)
        saved = {k.removeprefix("checkpoint_") for k in row if k.startswith("checkpoint_")}
        assert saved == set(formats), (variant, saved)
        for name in formats:
            check = row[f"checkpoint_{name}"]
            assert check["tensors"] > 0 and check["scrambled"] == check["tensors"], (variant, check)
            assert check["load_mismatched"] == 0, (variant, name, check)
            assert check["size_mb"] >= 3 * result["P_mb"] * 0.95, (variant, name, check)
        assert row["worst_phase_P"] == max(row[p]["peak_P"] for p in bench.PHASES)


def test_bad_arguments_are_refused_naming_the_value(
    capsys: pytest.CaptureFixture, import_benchmark
) -> None:
    bench = import_benchmark("bigmodel")
    with pytest.raises(SystemExit):
        bench.main(["--variants", "rankwise-eager,ddp"])
    assert "['ddp']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--world", "1"])
    assert "[1]" in capsys.readouterr().err
