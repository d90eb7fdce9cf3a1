"""Data-parallel engines, each built from small pieces.

DataParallel = scatter + replicate + parallel_apply + gather (one process, a thread per device).
DistributedDataParallel = buckets + reducer + a thin wrapper (one process per device).
ShardedDataParallel = flat shard layout + the same hook pattern (ZeRO stages 1-3).
"""

from .ddp.distributed import DistributedDataParallel
from .dp.data_parallel import DataParallel
from .dp.parallel_apply import parallel_apply
from .dp.replicate import replicate
from .dp.scatter_gather import gather, scatter
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from .zero.sharded import ShardedDataParallel

__all__ = [
    "DataParallel",
    "DistributedDataParallel",
    "ShardedDataParallel",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "gather",
    "parallel_apply",
    "replicate",
    "scatter",
]
