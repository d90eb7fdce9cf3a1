"""The fast tier (`python -m pytest -m fast`, tests/fast_tier.py) names real tests, and a fast run
touches every module of src/rankwise: imported by a fast test or by a process it started."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fast_tier

ROOT = Path(__file__).resolve().parents[2]


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


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
    """Runs last in `pytest -m fast` (conftest orders it), over what the fast tests imported.
    Under pytest-xdist the controller takes the same census once every worker has ended
    (tests/fast_tier.py, ``pytest_sessionfinish``): a worker cannot wait for the others."""
    config = request.config
    if fast_tier.under_xdist(config):
        pytest.skip("under pytest-xdist the controller takes the census after every worker")
    ran = {i.nodeid for i in getattr(request.session, "items", [])}
    why, untouched = fast_tier.census(config, ran)
    if why is not None:
        pytest.skip(why)
    assert not untouched, fast_tier.untouched_message(untouched)


_FORKED = """
import rankwise.testing as t

def rank():
    import rankwise.models.resnet  # only this rank imports it
    return 1

if __name__ == "__main__":
    print(t.run_distributed(rank, world_size=2, start_method={method!r}, timeout=60))
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_rank_logs_its_imports_whether_spawned_or_forked_from_the_server(
    tmp_path: Path, method: str
) -> None:
    """A forked rank ends by ``os._exit`` (no ``atexit``) and its server was started before the
    test set its log folder: the census must still see what the rank imported. (CI once failed
    the census for rankwise.models, imported only by forked ranks.)"""
    import os
    import subprocess
    import sys

    folder = tmp_path / "log"
    folder.mkdir()
    script = tmp_path / "main.py"
    script.write_text(_FORKED.format(method=method))
    env = {
        **os.environ,
        fast_tier.DIR_VAR: str(tmp_path),
        fast_tier.LOG_VAR: str(folder),
        "PYTHONPATH": os.pathsep.join([str(fast_tier.IMPORTS), str(fast_tier.SRC)]),
    }
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    logs = {p.name: p.read_text().split() for p in folder.glob("process-*.txt")}
    ranks = [name for name, mods in logs.items() if "rankwise.models.resnet" in mods]
    assert len(ranks) >= 2, f"{method}: the ranks' imports are not in the logs: {sorted(logs)}"
