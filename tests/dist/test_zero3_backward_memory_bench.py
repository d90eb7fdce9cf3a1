"""benchmarks/zero3_backward_memory.py runs end to end on a small model (world 2, 4 x 1024), and
what it finds holds there: on the CPU the backward pass peaks where FSDP2's does, no higher
(within a quarter of a layer), with prefetch 1 (the default) and 0, and every layer's two
windows and the end are reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.slow  # three spawned groups of two ranks
@pytest.mark.timeout(600)
def test_the_backward_peaks_no_higher_than_fsdp2_and_every_window_is_reported(
    tmp_path: Path, import_benchmark
) -> None:
    bench = import_benchmark("zero3_backward_memory")
    out = tmp_path / "z3.json"
    result = bench.main(["--size", "1024", "--layers", "4", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    windows = [f"{k}{i}" for i in range(3, -1, -1) for k in ("pre", "post")] + ["end"]
    rows = result["variants"]
    assert set(rows) == set(bench.VARIANTS)
    for name, row in rows.items():
        assert list(row["peak_mib"]) == windows, name
        assert row["worst"]["mib"] == max(row["peak_mib"].values()), name
        # a layer's own backward computes its full gradient: above a unit over its start
        assert row["peak_mib"]["post2"] >= row["resident_mib"]["pre2"] + result["unit_mib"] * 0.9
    unit, theirs = result["unit_mib"], rows["fsdp2"]["worst"]["mib"]
    for name in ("rankwise-prefetch1", "rankwise-prefetch0"):  # on the CPU, no reduction in
        assert rows[name]["worst"]["mib"] <= theirs + unit / 4, (name, rows)  # flight (as FSDP2)


def test_bad_arguments_are_refused_naming_the_value(
    capsys: pytest.CaptureFixture, import_benchmark
) -> None:
    bench = import_benchmark("zero3_backward_memory")
    with pytest.raises(SystemExit):
        bench.main(["--variants", "rankwise-prefetch1,ddp"])
    assert "['ddp']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--world", "1"])
    assert "(got 1)" in capsys.readouterr().err
