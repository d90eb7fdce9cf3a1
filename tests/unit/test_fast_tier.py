"""The fast tier (`python -m pytest -m fast`, tests/fast_tier.py) names real tests, and a fast run
touches every module of src/rankwise: imported by a fast test or by a process it started."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fast_tier

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def _modules() -> list[str]:
    names = []
    for path in sorted((SRC / "rankwise").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_entry_names_a_test_that_exists() -> None:
    wrong = []
    for entry in fast_tier.entries():
        file, _, test = entry.partition("::")
        path = ROOT / file
        if not path.is_file():
            wrong.append(f"{entry}: no file {file}")
        elif test and test.split("[")[0] not in _tests_in(path):
            wrong.append(f"{entry}: {file} has no test {test.split('[')[0]}")
    assert not wrong, "tests/fast_tier.py names tests that do not exist:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    ("entry", "nodeid", "selected"),
    [
        ("tests/unit/test_loader.py", "tests/unit/test_loader.py::test_x[2]", True),
        ("tests/unit/test_loader.py", "tests/unit/test_loader_epochs.py::test_x", False),
        ("tests/dist/a.py::test_b", "tests/dist/a.py::test_b[zero3]", True),
        ("tests/dist/a.py::test_b", "tests/dist/a.py::test_bb", False),
        ("tests/dist/a.py::test_b[zero3]", "tests/dist/a.py::test_b[zero3]", True),
    ],
)
def test_an_entry_selects_its_tests_only(entry: str, nodeid: str, selected: bool) -> None:
    assert fast_tier.selects(entry, nodeid) is selected


def test_the_fast_tier_touches_every_module(request: pytest.FixtureRequest) -> None:
    """Runs last in `pytest -m fast` (conftest orders it), over what the fast tests imported."""
    config = request.config
    items = getattr(request.session, "items", [])
    if getattr(config, "fast_tier_log", None) is None or config.option.keyword:
        pytest.skip("checks a whole fast run: python -m pytest -m fast")
    ran = {i.nodeid for i in items}
    missing_entries = [e for e in fast_tier.entries() if not any(fast_tier.selects(e, n) for n in ran)]
    if missing_entries:
        pytest.skip(f"not the whole fast tier in this run: {missing_entries[:3]} ...")
    touched = fast_tier.touched(config, fast_tier.NO_CREDIT)
    untouched = [m for m in _modules() if m not in touched]
    assert not untouched, (
        f"{len(untouched)} modules of src/rankwise are imported by no fast test (nor by a process "
        f"one starts), so `pytest -m fast` would pass with them broken:\n  "
        + "\n  ".join(untouched)
        + "\nAdd the cheapest test that exercises each to FAST in tests/fast_tier.py."
    )
