"""The order files go to pytest-xdist's workers (``-n 2 --dist loadfile``, .ci/run's pass of the
tests past the fast tier): the longest first, by the seconds the last measured CI run spent in
each (``benchmarks/results/ci_time.json``, ``files_s`` of each pass, from benchmarks/ci_time.py).

A file is one unit of work (its module's shared job runs once); xdist hands the units out in
order as workers free up. Its own order (more tests first) can leave a long file of few tests
for last while the other worker idles: longest first, the two workers end within about the
length of the last file. Files without a figure (new ones) follow, in xdist's order. The fast
tier keeps collection order: its census needs the tests that import every module last on
each worker (tests/fast_tier.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

KEY = "rankwise_order_files"
COSTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "ci_time.json"


def costs(path: Path = COSTS) -> dict[str, float]:
    """Test file -> the most seconds any measured pass spent in it."""
    try:
        passes = json.loads(path.read_text()).get("passes", {})
    except (OSError, ValueError):
        return {}
    found: dict[str, float] = {}
    for one in passes.values():
        for file, seconds in one.get("files_s", {}).items():
            found[file] = max(found.get(file, 0.0), float(seconds))
    return found


def applies(config: pytest.Config) -> bool:
    """A loadfile pass past the fast tier (a worker is told by the controller: its own
    options read ``dist=no``)."""
    if hasattr(config, "workerinput"):
        return bool(config.workerinput.get(KEY))
    return config.getoption("dist", "no") == "loadfile" and config.option.markexpr != "fast"


def configure(config: pytest.Config) -> None:
    """In the controller: keep the workers' order of files (xdist would sort them by count)."""
    config.pluginmanager.register(sys.modules[__name__], "xdist_order")
    if not hasattr(config, "workerinput") and applies(config) and costs():
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """The controller tells each worker whether to order the files it collects."""
    node.workerinput[KEY] = applies(node.config) and bool(costs())


def order(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with a figure first, longest first; then the others, more tests first (xdist's
    own order); the tests of a file stay in their order."""
    cost = costs() if applies(config) else {}
    if not cost:
        return
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    ranked = sorted(files, key=lambda f: (-cost.get(f, 0.0), -len(files[f])))
    items[:] = [item for file in ranked for item in files[file]]
