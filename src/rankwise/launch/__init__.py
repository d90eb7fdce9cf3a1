"""Launching a job: ``rankwise run`` and ``python -m rankwise.launch`` on torch.distributed.elastic.

From Python::

    from rankwise.launch import LaunchOptions, launch
    launch(LaunchOptions(script="train.py", nproc_per_node=2))

A function (from a notebook, say) in N processes: ``rw.launch(train, nprocs=2)``. ``rw.launch``
is this package, made callable (``rankwise.launch.notebook.launch_function``): the attribute
``rankwise.launch`` is the package as soon as it is imported, so the function could not keep
the name any other way.
"""

import sys
import types
from typing import Any

from .engine import LaunchInterrupted, launch
from .failures.report import JobFailed, RankFailure
from .notebook import launch_function
from .options import LaunchOptions

__all__ = [
    "JobFailed",
    "LaunchInterrupted",
    "LaunchOptions",
    "RankFailure",
    "launch",
    "launch_function",
]


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        return launch_function(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
