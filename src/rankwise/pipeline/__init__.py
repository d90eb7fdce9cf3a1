"""Model parallel: split a sequential model over devices or ranks, and pipeline micro-batches.

- ``split(model, devices, balance, chunks)``: one process, stages on several devices (``Pipe``).
- ``DistributedPipeline(model, ranks=..., chunks=...)``: one stage per process, send/recv.
- ``balance_by_params`` / ``balance_by_time``: layer counts per stage, computed.
- ``gpipe_clock`` / ``bubble_fraction`` / ``measured_bubble``: the schedule, in theory and as run.
"""

from .distributed import DistributedPipeline
from .partition import balance_by_params, balance_by_time
from .pipe import Pipe, split
from .schedule import ScheduleEvent, bubble_fraction, gpipe_clock, measured_bubble

__all__ = [
    "DistributedPipeline",
    "Pipe",
    "ScheduleEvent",
    "balance_by_params",
    "balance_by_time",
    "bubble_fraction",
    "gpipe_clock",
    "measured_bubble",
    "split",
]
