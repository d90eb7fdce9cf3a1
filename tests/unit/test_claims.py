"""The claims registry (``claims_registry``): every quantitative or equality claim in README.md
and docs/*.md carries a marker naming the test or benchmark result that measures it, and every
marker names something that exists."""

from __future__ import annotations

from pathlib import Path

import claims_registry as cr
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", cr.pages(ROOT), ids=lambda p: p.name)
def test_every_claim_names_what_measures_it(page):
    found = cr.unmarked_claims(page, ROOT) + cr.bad_markers(page, ROOT)
    assert not found, "\n".join(map(str, found)) + (
        "\nFix: put <!-- claim: tests/path.py::test_name --> or "
        "<!-- claim: benchmarks/results/file.json --> right after the claim, naming what "
        "measures it under the stated conditions; or say only what is measured."
    )


def _check(tmp_path: Path, text: str) -> list[str]:
    (tmp_path / "docs").mkdir(exist_ok=True)
    page = tmp_path / "docs" / "page.md"
    page.write_text(text)
    return [str(f) for f in cr.unmarked_claims(page, tmp_path) + cr.bad_markers(page, tmp_path)]


@pytest.mark.parametrize(
    "claim",
    ["bitwise equal", "bit for bit", "bit-exact", "bit-identical", "≤ 4 s", "<= 0.8",
     "within 8%", "within 2 s", "to 1e-6", "2.4e-7 apart", "1.5x faster", "2× slower",
     "+8.8% slower", "3 % more"],
)  # fmt: skip
def test_the_detector_finds_each_kind_of_claim(tmp_path, claim):
    found = _check(tmp_path, f"Intro.\n\nOurs is {claim} than theirs. Next sentence.\n")
    assert len(found) == 1 and "docs/page.md:3" in found[0] and claim in found[0], found


@pytest.mark.parametrize(
    "text",
    ["a 2 x 4 mesh", "torch>=2.0", "`rtol=1e-6` in code", "[link](a/1e-6.md)",
     "```\nx = 1e-6  # bitwise\n```", "world size > 1", "step 3 of 10"],
)  # fmt: skip
def test_the_detector_leaves_what_is_not_a_claim(tmp_path, text):
    assert _check(tmp_path, f"Some text:\n{text}\n") == []


def test_a_marker_covers_its_sentence_and_must_name_something(tmp_path):
    (tmp_path / "tests" / "dist").mkdir(parents=True)
    (tmp_path / "tests" / "dist" / "test_x.py").write_text("def test_y(): pass\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "r.json").write_text('{"a": {"b": 1}}')
    ok = "<!-- claim: tests/dist/test_x.py::test_y -->"
    assert _check(tmp_path, f"It is bitwise equal. {ok} Then 2x faster {ok}.\n") == []
    assert _check(tmp_path, f"It is bitwise equal {ok}, and done.\n") == []
    assert _check(tmp_path, "Within 8% <!-- claim: benchmarks/results/r.json#a/b -->.\n") == []
    assert _check(tmp_path, f"Param ok. {ok}\n") == []  # an extra marker is no claim
    late = _check(tmp_path, f"It is bitwise equal. Another sentence. {ok}\n")
    assert len(late) == 1 and "'bitwise'" in late[0] and "docs/page.md:1" in late[0]
    for bad, why in [
        ("tests/dist/test_x.py::test_z", "no test test_z"),
        ("tests/dist/test_q.py::test_y", "no test file"),
        ("benchmarks/results/none.json", "no benchmark result"),
        ("benchmarks/results/r.json#a/c", "no key 'a/c'"),
    ]:
        found = _check(tmp_path, f"Bitwise equal <!-- claim: {bad} -->.\n")
        assert len(found) == 1 and why in found[0] and bad in found[0], found
    assert _check(tmp_path, "Bitwise <!-- claim: tests/dist/test_x.py::test_y[zero3] -->.\n") == []
    for malformed in (
        "<!-- claim: tests/dist/test_x.py::test_y (load 3) -->",
        "<!-- claim tests -->",
    ):
        found = _check(tmp_path, f"Bitwise {malformed}.\n")
        assert any("malformed marker" in f for f in found), found


def test_a_table_is_covered_by_one_marker_around_it(tmp_path):
    table = "| a | b |\n|---|---|\n| 1.5x | 3% |\n"
    found = _check(tmp_path, "Measured:\n\n" + table)
    assert len(found) == 1 and "docs/page.md:5" in found[0]
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("{}")
    marker = "<!-- claim: benchmarks/results/r.json -->"
    assert _check(tmp_path, f"Measured {marker}:\n\n" + table) == []
    assert _check(tmp_path, "Measured:\n\n" + table + marker + "\n") == []
