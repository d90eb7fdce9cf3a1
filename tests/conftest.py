"""Shared test set-up: the source tree on the path of every spawned process too."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
ROOT = Path(__file__).resolve().parents[1]

# Children started by the launcher (subprocesses, not multiprocessing) find rankwise this way.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [SRC, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# run_distributed's ranks fork from a server that imported torch once (about 2 s less per rank,
# a third of the multi-process tests' time on two cores); tests of spawn itself pass it.
os.environ.setdefault("RANKWISE_START_METHOD", "forkserver")


@pytest.fixture(autouse=True)
def _own_environment():
    """Every test ends with the environment it started with: a variable one test's code sets
    (``RANKWISE_RUN_DIR``, ``RANK``) must not reach a later test's subprocesses, whichever
    order ``pytest -n 2`` gives the files."""
    from rankwise.launch.engine import kept_environ

    with kept_environ():
        yield


@pytest.fixture(autouse=True)
def _fresh_runtime():
    """Every test starts and ends without a rankwise runtime in this process."""
    import rankwise

    rankwise.shutdown()
    yield
    rankwise.shutdown()


@pytest.fixture
def import_benchmark(monkeypatch: pytest.MonkeyPatch):
    """``import_benchmark("bigmodel")``: a script of benchmarks/ as a module, imported from
    sys.path (the benchmarks' spawned ranks import it the same way)."""

    def load(name: str):
        monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
        return importlib.import_module(name)

    return load


def pytest_configure(config: pytest.Config) -> None:
    """The fast tier (``-m fast``, README's second command): tests/fast_tier.py."""
    import fast_tier
    import xdist_order

    config.pluginmanager.register(fast_tier, "fast_tier")
    fast_tier.start(config)
    xdist_order.configure(config)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip on machines without CUDA, so a marker alone is enough.
    Tests listed in tests/fast_tier.py are marked ``fast`` (before ``-m`` selects).

    ``benchmarks/gpu_check.sh`` selects them all with ``-m gpu`` on a GPU machine.
    """
    import torch

    import fast_tier
    import xdist_order

    fast_tier.mark(items)
    xdist_order.order(config, items)  # under xdist (.ci/run): the longest files first
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs CUDA (run benchmarks/gpu_check.sh)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
