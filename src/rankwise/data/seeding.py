"""``rw.seed_everything(seed)``: every random stream of a run from one number, per rank as stated.

Which stream gets what (``r``: this rank's index among the data-parallel replicas: the global
rank, or the data coordinate under ``rw.init(mesh=...)``):

| stream | default | ``per_rank=True`` |
|---|---|---|
| Python ``random``, numpy's global RNG, torch CPU and every CUDA device (this process) | ``seed`` | ``seed + r`` |
| the sampler's shuffle of loaders ``rw.loader``/``rt.prepare`` build | ``seed`` (+ epoch) | ``seed`` (+ epoch) |
| their DataLoader workers (``random``, numpy, torch in each worker) | from (``seed``, ``r``, epoch) + worker id | the same |

Why: the main-process streams build the model, and every rank must build the same one (a
model that is not broadcast, e.g. built before ``rt.prepare`` or sharded by rank, drifts
otherwise): same seed everywhere, as Lightning's ``seed_everything`` and Accelerate's
``set_seed`` do by default. The shuffle must be one permutation that the ranks split, so it is
never offset. Workers augment different samples on every rank and should not repeat each
other's random draws, so their seeds differ per rank, per worker and per epoch, and are the
same in a rerun or a resumed run (the loader reseeds its generator from them at each epoch;
torch then seeds each worker's ``random``, numpy and torch from it). ``per_rank=True``
(Accelerate's ``device_specific=True``) offsets the main-process streams after the model is
built, for dropout masks or main-process augmentation that should differ between replicas;
tensor-parallel and pipeline peers (same data coordinate) keep the same stream, as a
replicated activation's dropout must.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from ..errors import ConfigError
from . import _coords

_seed: int | None = None
"""The last ``seed_everything`` seed: the default of loaders built after it (process-wide, as
torch's own RNG is)."""


def seed_everything(seed: int, *, per_rank: bool = False) -> int:
    """Seed Python's ``random``, numpy's global RNG and torch (CPU and every CUDA device) with
    ``seed`` (``per_rank=True``: ``seed + r``, ``r`` the data-parallel rank), and make the loaders
    ``rw.loader`` and ``rt.prepare`` build from now on shuffle with ``seed`` and seed their
    workers from (``seed``, rank, epoch). Returns the number the main-process streams got.

    Call it on every rank with the same ``seed``, before building the model (and, under a
    mesh, after ``rw.init(mesh=...)`` when ``per_rank``). No sync point.
    """
    global _seed
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ConfigError(
            f"seed_everything(seed={seed!r}): a seed is a whole number in 0 .. 2**32 - 1 "
            "(numpy's range)",
            fix="pass e.g. rw.seed_everything(42).",
        )
    seed = int(seed)
    main = (seed + _coords.coords()[0]) % 2**32 if per_rank else seed
    random.seed(main)
    np.random.seed(main)
    torch.manual_seed(main)  # every CUDA device's generator too
    _seed = seed
    return main


def default_seed() -> int:
    """A loader's ``seed`` when it is given none: the last ``seed_everything``'s, else 0."""
    return 0 if _seed is None else _seed
