"""rankwise: data-parallel and model-parallel training for PyTorch, on one machine or many.

Names are imported on first use (PEP 562): ``import rankwise`` stays cheap, so commands that
need no torch (``rankwise check``, ``rankwise topology``) start fast, and the launcher does not
import the training engines it only starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

_LAZY: dict[str, str] = {
    "all_gather_object": ".comm.collectives",
    "all_reduce": ".comm.collectives",
    "all_reduce_max": ".comm.collectives",
    "all_reduce_mean": ".comm.collectives",
    "all_reduce_sum": ".comm.collectives",
    "barrier": ".comm.collectives",
    "broadcast_object": ".comm.collectives",
    "ColumnParallelLinear": ".parallel.tensor",
    "ConfigError": ".errors",
    "DataParallel": ".parallel",
    "DeviceMesh": ".job.mesh",
    "DistEnv": ".job.env",
    "DistributedDataParallel": ".parallel",
    "DistributedError": ".errors",
    "DistributedPipeline": ".pipeline",
    "DistributedSampler": ".data",
    "EnvError": ".errors",
    "gather_for_metrics": ".data",
    "gather_object": ".comm.collectives",
    "get_logger": ".output.log",
    "get_runtime": ".runtime",
    "init": ".session",
    "init_mesh": ".job.mesh",
    "is_initialized": ".runtime",
    "join": ".data",
    "launch": ".launch",
    "list_checkpoints": ".checkpoint",
    "load_checkpoint": ".checkpoint",
    "Loader": ".data",
    "loader": ".data",
    "load_pretrained": ".checkpoint.pretrained",
    "Pipe": ".pipeline",
    "print0": ".output.log",
    "progress": ".output.progress",
    "RankwiseError": ".errors",
    "RowParallelLinear": ".parallel.tensor",
    "Runtime": ".runtime",
    "RuntimeStateError": ".errors",
    "save_checkpoint": ".checkpoint",
    "save_pretrained": ".checkpoint.pretrained",
    "seed_everything": ".data",
    "Session": ".session",
    "ShardedIterable": ".data",
    "ShardedDataParallel": ".parallel",
    "SyncBatchNorm": ".parallel",
    "convert_sync_batchnorm": ".parallel",
    "shutdown": ".runtime",
    "Slot": ".topology",
    "split": ".pipeline",
    "tensor_parallel": ".parallel.tensor",
    "Topology": ".topology",
    "unwrap_model": ".checkpoint",
    "updates": ".updates",
    "vocab_parallel_cross_entropy": ".parallel.tensor",
    "VocabParallelEmbedding": ".parallel.tensor",
}
"""Public name -> the module that defines it (``updates`` is a module itself)."""


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'rankwise' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name], __name__)
    value = module if name in ("updates", "launch") else getattr(module, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    # The public API only: not the submodules imported so far, nor this file's helpers.
    return sorted(__all__)


if TYPE_CHECKING:  # static analysers and IDEs see the eager imports
    from . import launch, updates
    from .checkpoint import list_checkpoints, load_checkpoint, save_checkpoint, unwrap_model
    from .checkpoint.pretrained import load_pretrained, save_pretrained
    from .comm.collectives import (
        all_gather_object,
        all_reduce,
        all_reduce_max,
        all_reduce_mean,
        all_reduce_sum,
        barrier,
        broadcast_object,
        gather_object,
    )
    from .data import (
        DistributedSampler,
        Loader,
        ShardedIterable,
        gather_for_metrics,
        join,
        loader,
        seed_everything,
    )
    from .errors import ConfigError, DistributedError, EnvError, RankwiseError, RuntimeStateError
    from .job.env import DistEnv
    from .job.mesh import DeviceMesh, init_mesh
    from .output.log import get_logger, print0
    from .output.progress import progress
    from .parallel import (
        DataParallel,
        DistributedDataParallel,
        ShardedDataParallel,
        SyncBatchNorm,
        convert_sync_batchnorm,
    )
    from .parallel.tensor import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        tensor_parallel,
        vocab_parallel_cross_entropy,
    )
    from .pipeline import DistributedPipeline, Pipe, split
    from .runtime import Runtime, get_runtime, is_initialized, shutdown
    from .session import Session, init
    from .topology import Slot, Topology

__all__ = [
    "ColumnParallelLinear",
    "ConfigError",
    "DataParallel",
    "DeviceMesh",
    "DistEnv",
    "DistributedDataParallel",
    "DistributedError",
    "DistributedPipeline",
    "DistributedSampler",
    "EnvError",
    "Loader",
    "Pipe",
    "RankwiseError",
    "RowParallelLinear",
    "Runtime",
    "RuntimeStateError",
    "Session",
    "ShardedDataParallel",
    "ShardedIterable",
    "Slot",
    "SyncBatchNorm",
    "Topology",
    "VocabParallelEmbedding",
    "__version__",
    "all_gather_object",
    "all_reduce",
    "all_reduce_max",
    "all_reduce_mean",
    "all_reduce_sum",
    "barrier",
    "broadcast_object",
    "convert_sync_batchnorm",
    "gather_for_metrics",
    "gather_object",
    "get_logger",
    "get_runtime",
    "init",
    "init_mesh",
    "is_initialized",
    "join",
    "launch",
    "list_checkpoints",
    "load_checkpoint",
    "load_pretrained",
    "loader",
    "print0",
    "progress",
    "save_checkpoint",
    "save_pretrained",
    "seed_everything",
    "shutdown",
    "split",
    "tensor_parallel",
    "unwrap_model",
    "updates",
    "vocab_parallel_cross_entropy",
]
"""The same names as ``_LAZY`` and the ``TYPE_CHECKING`` imports (a literal, for static
analysers); ``tests/unit/test_public_api.py`` checks that the three lists agree."""
