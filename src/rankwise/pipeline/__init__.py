"""Model parallel: split a sequential model over devices or ranks, and pipeline micro-batches.

- ``split(model, devices, balance, chunks)``: one process, stages on several devices (``Pipe``).
- ``DistributedPipeline(model, ranks=..., chunks=...)``: one stage per process, send/recv.
- ``balance_by_params`` / ``balance_by_time``: layer counts per stage, computed.
- ``gpipe_clock`` / ``bubble_fraction`` / ``measured_bubble``: the schedule, in theory and as run.
- ``schedules`` (pure: per-rank action lists), ``simulate`` (deadlock, bubble, memory on paper),
  ``executor`` (runs any schedule), ``PipelineModel`` (what ``rt.prepare`` returns under a
  pipeline mesh).
"""

from .distributed import DistributedPipeline
from .execution.gpipe import ScheduleEvent, bubble_fraction, gpipe_clock, measured_bubble
from .model import PipelineModel
from .partition import balance_by_params, balance_by_time
from .pipe import Pipe, split

__all__ = [
    "DistributedPipeline",
    "Pipe",
    "PipelineModel",
    "ScheduleEvent",
    "balance_by_params",
    "balance_by_time",
    "bubble_fraction",
    "gpipe_clock",
    "measured_bubble",
    "split",
]
