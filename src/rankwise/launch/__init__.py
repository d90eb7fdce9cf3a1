"""Launching a job: ``rankwise run`` and ``python -m rankwise.launch`` on torch.distributed.elastic.

From Python::

    from rankwise.launch import LaunchOptions, launch
    launch(LaunchOptions(script="train.py", nproc_per_node=2))
"""

from .engine import LaunchInterrupted, launch
from .options import LaunchOptions
from .report import JobFailed, RankFailure

__all__ = ["JobFailed", "LaunchInterrupted", "LaunchOptions", "RankFailure", "launch"]
