"""Data parallelism engines. DataParallel = scatter + replicate + parallel_apply + gather."""

from .data_parallel import DataParallel
from .parallel_apply import parallel_apply
from .replicate import replicate
from .scatter_gather import gather, scatter

__all__ = ["DataParallel", "gather", "parallel_apply", "replicate", "scatter"]
