"""Data-parallel engines, each built from small pieces.

DataParallel = scatter + replicate + parallel_apply + gather (one process, a thread per device).
DistributedDataParallel = buckets + reducer + a thin wrapper (one process per device).
ShardedDataParallel = flat shard layout + the same hook pattern (ZeRO stages 1-3).
"""

from .data_parallel import DataParallel
from .distributed import DistributedDataParallel
from .parallel_apply import parallel_apply
from .replicate import replicate
from .scatter_gather import gather, scatter
from .sharded import ShardedDataParallel

__all__ = [
    "DataParallel",
    "DistributedDataParallel",
    "ShardedDataParallel",
    "gather",
    "parallel_apply",
    "replicate",
    "scatter",
]
