"""Weights & Biases: one ``wandb.init`` run per ``rt.log_to``, files under the log folder.

The run's files go to ``<log_dir>/wandb/`` (``dir=log_dir``). Whether it syncs is W&B's own
choice: ``WANDB_MODE=offline`` (or ``init_kwargs={"wandb": {"mode": "offline"}}``) writes
locally with no network and no login (``wandb sync <log_dir>/wandb/offline-run-*`` uploads
it later). Every other ``wandb.init`` argument (``entity``, ``group``, ``tags``, ``mode``,
``settings``, ...) passes through ``init_kwargs={"wandb": {...}}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import RunInfo


class WandbTracker:
    name = "wandb"

    def __init__(self, log_dir: Path, run: RunInfo, **kwargs: Any) -> None:
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        given = {"project": run.project, "name": run.run_name, "config": run.config or None}
        self.run = wandb.init(**{**given, "dir": str(log_dir), **kwargs})
        """The ``wandb`` run: ``rt.log_to().tracker("wandb").run``."""

    def log(self, values: dict[str, float], step: int, wall_time: float) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool = False) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        # finish() can return before W&B's service process has written the run's file; when
        # no other run of this process is open, stop the service, which writes it all, so the
        # files are complete when rw.shutdown() returns (wandb sync, a test reading them).
        if wandb.run is None:
            wandb.teardown()
