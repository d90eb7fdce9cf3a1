"""Data-parallel engines: rankwise's own DistributedDataParallel (and its pieces)."""

from .distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
