"""Data for data-parallel training: who reads what, in which order, in batches of what size.

- ``DistributedSampler``: torch's partition, plus a forgotten-``set_epoch`` warning, an
  evaluation mode without padding, and exact resume (``sampler.py``).
- ``loader``/``Loader``: a DataLoader with an explicit batch-size contract (``batching.py``).
- ``gather_for_metrics``: evaluation outputs of all ranks, each sample once, in order
  (``metrics.py``).
- ``join``: all ranks stop together on truly uneven iterators (``uneven.py``).
- ``ShardedIterable``: iterable datasets split by rank and DataLoader worker (``iterable.py``).
- ``seed_everything``: every random stream from one seed, per rank as documented
  (``seeding.py``).
"""

from .batching import Loader, loader, per_device_batch
from .iterable import ShardedIterable
from .metrics import gather_for_metrics
from .sampler import DistributedSampler
from .seeding import seed_everything
from .uneven import Join, join

__all__ = [
    "DistributedSampler",
    "Join",
    "Loader",
    "ShardedIterable",
    "gather_for_metrics",
    "join",
    "loader",
    "per_device_batch",
    "seed_everything",
]
