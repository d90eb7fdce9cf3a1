"""rankwise: data-parallel and model-parallel training for PyTorch, on one machine or many."""

from . import updates
from .checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from .comm import (
    all_gather_object,
    all_reduce,
    all_reduce_max,
    all_reduce_mean,
    all_reduce_sum,
    barrier,
    broadcast_object,
    gather_object,
)
from .data import DistributedSampler, Loader, ShardedIterable, gather_for_metrics, join, loader
from .env import DistEnv
from .errors import ConfigError, DistributedError, EnvError, RankwiseError, RuntimeStateError
from .log import get_logger, print0
from .parallel import DataParallel, DistributedDataParallel
from .pipeline import DistributedPipeline, Pipe, split
from .progress import progress
from .runtime import Runtime, get_runtime, init, is_initialized, shutdown
from .state import unwrap_model
from .topology import Slot, Topology

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DataParallel",
    "DistEnv",
    "DistributedDataParallel",
    "DistributedError",
    "DistributedPipeline",
    "DistributedSampler",
    "EnvError",
    "Loader",
    "Pipe",
    "RankwiseError",
    "Runtime",
    "RuntimeStateError",
    "ShardedIterable",
    "Slot",
    "Topology",
    "__version__",
    "all_gather_object",
    "all_reduce",
    "all_reduce_max",
    "all_reduce_mean",
    "all_reduce_sum",
    "barrier",
    "broadcast_object",
    "gather_for_metrics",
    "gather_object",
    "get_logger",
    "get_runtime",
    "init",
    "is_initialized",
    "join",
    "list_checkpoints",
    "load_checkpoint",
    "loader",
    "print0",
    "progress",
    "save_checkpoint",
    "shutdown",
    "split",
    "unwrap_model",
    "updates",
]
