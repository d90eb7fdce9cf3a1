"""``rt.log`` to MLflow and W&B (offline) from 2 processes: rank 0 alone writes one run, whose
values are the ranks' values reduced (compared with the mean computed here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import rankwise as rw
from rankwise.testing import run_distributed

pytest.importorskip("mlflow")
pytest.importorskip("wandb")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from tracker_files import mlflow_runs, wandb_run

STEPS = 3


def _value(rank: int, step: int) -> float:
    return 0.5 * rank + 0.25 * step + 1.0


def _log(log_dir: str) -> bool:
    rt = rw.init()
    logger = rt.log_to(log_dir, log_with=["csv", "mlflow", "wandb"], project="dist",
                       run_name="two-ranks", config={"world": rt.world_size})
    opened = logger.tracker("mlflow") is not None
    for step in range(STEPS):
        rt.log({"loss": _value(rt.rank, step), "seen": 8.0 * (rt.rank + 1)}, step=step,
               reduce="mean")
    rw.shutdown()
    return opened


@pytest.mark.slow  # MLflow creates its database, W&B starts its service: ~30 s quiet
def test_two_ranks_log_one_reduced_run(tmp_path):
    opened = run_distributed(_log, 2, args=(str(tmp_path),), timeout=300,
                             env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert opened == [True, False]  # rank 1 opens no tracker
    loss = [(s, (_value(0, s) + _value(1, s)) / 2) for s in range(STEPS)]
    seen = [(s, (8.0 + 16.0) / 2) for s in range(STEPS)]
    (run,) = mlflow_runs(tmp_path, "dist")  # one run, not one per rank
    assert (run["name"], run["status"], run["params"]) == ("two-ranks", "FINISHED", {"world": "2"})
    assert run["metrics"] == {"loss": loss, "seen": seen}
    wb = wandb_run(tmp_path)  # asserts there is exactly one offline run
    assert wb["config"] == {"world": 2} and wb["exit_code"] == 0
    assert [(h["step"], h["loss"], h["seen"]) for h in wb["history"]] == [
        (s, v, 12.0) for s, v in loss
    ]
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * STEPS  # the header, then each value once
