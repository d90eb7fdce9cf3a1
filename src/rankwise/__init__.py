"""rankwise: data-parallel and model-parallel training for PyTorch, on one machine or many."""

from . import updates
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
from .env import DistEnv
from .errors import ConfigError, DistributedError, EnvError, RankwiseError, RuntimeStateError
from .log import get_logger, print0
from .runtime import Runtime, get_runtime, init, is_initialized, shutdown
from .topology import Slot, Topology

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DistEnv",
    "DistributedError",
    "EnvError",
    "RankwiseError",
    "Runtime",
    "RuntimeStateError",
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
    "gather_object",
    "get_logger",
    "get_runtime",
    "init",
    "is_initialized",
    "print0",
    "shutdown",
    "updates",
]
