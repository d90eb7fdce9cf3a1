"""TensorBoard: event files written by torch's own ``torch.utils.tensorboard.SummaryWriter``.

The run's ``config`` is written once as hyperparameters (TensorBoard's HPARAMS tab) into the
same event files as the curves (``SummaryWriter.add_hparams`` would start a second run in a
sub-folder). Open with ``tensorboard --logdir rankwise_logs``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import RunInfo


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, log_dir: Path, run: RunInfo, **kwargs: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        kwargs.setdefault("flush_secs", 10)
        self.writer = SummaryWriter(log_dir=str(log_dir), **kwargs)
        """torch's ``SummaryWriter``: ``rt.log_to().tracker("tensorboard").writer``."""
        if run.config:
            events = self.writer._get_file_writer()  # the writer's own files, not a new run
            for summary in hparams(run.flat_config(), {}):
                events.add_summary(summary)

    def log(self, values: dict[str, float], step: int, wall_time: float) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step, walltime=wall_time)

    def close(self, failed: bool = False) -> None:
        self.writer.close()
