"""The batch-size contract (docs/pitfalls.md#pitfall-4), as arithmetic: which per-device batch
a ``batch_size`` or a ``global_batch_size`` means, with errors that name the nearest valid values.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from .. import validate
from ..errors import ConfigError


def per_device_batch(
    batch_size: int | None,
    global_batch_size: int | None,
    num_replicas: int,
    replicas_in_process: int = 1,
) -> int:
    """The per-device batch implied by exactly one of the two sizes; errors say the fix."""
    _check_positive("replicas_in_process", replicas_in_process, "2 (devices DataParallel uses)")
    replicas = num_replicas * replicas_in_process
    if batch_size is not None and global_batch_size is not None:
        raise ConfigError(
            f"both batch_size={batch_size} and global_batch_size={global_batch_size} were given",
            fix=f"pass exactly one: batch_size is per device, global_batch_size is per step over "
            f"all {replicas} replica(s) (e.g. global_batch_size={global_batch_size} alone).",
        )
    if batch_size is None and global_batch_size is None:
        raise ConfigError(
            "neither batch_size nor global_batch_size was given",
            fix=f"pass exactly one: batch_size= (samples per device per step) or "
            f"global_batch_size= (samples per step over all {replicas} replica(s)).",
        )
    name, value = (
        ("batch_size", batch_size)
        if batch_size is not None
        else ("global_batch_size", global_batch_size)
    )
    _check_positive(name, value, "32")
    if batch_size is not None:
        return batch_size
    if global_batch_size % replicas:
        raise ConfigError(
            f"global_batch_size={global_batch_size} does not divide evenly over {replicas} "
            f"replicas ({num_replicas} process(es) x {replicas_in_process} device(s) each)",
            fix=f"use global_batch_size={_nearest(global_batch_size, replicas)}, or pass "
            "batch_size= (per device) instead.",
        )
    return global_batch_size // replicas


def check_loader_arguments(dataset: Any, seed: Any, sampler: Any) -> None:
    """``rw.loader``'s arguments the batch sizes do not cover, by type (validate.py)."""
    sized = hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    if not (sized or isinstance(dataset, IterableDataset)):
        validate.fail("dataset", dataset, "a data set (with len() and [index]) or an "
                      "IterableDataset", where="rw.loader()", fix="pass the data set itself, e.g. "
                      "rw.loader(TensorDataset(x, y), batch_size=32).")  # fmt: skip
    validate.integer("seed", seed, where="rw.loader()")
    if sampler is not None and (isinstance(sampler, (str, bytes)) or not hasattr(sampler, "__iter__")):
        validate.fail("sampler", sampler, "a torch Sampler (an iterable of indices) or None",
                      where="rw.loader()", fix="pass e.g. sampler=rw.DistributedSampler(dataset), "
                      "or shuffle=True and no sampler.")  # fmt: skip


def check_built_loader(dataloader: Any, sizes: dict[str, Any], generator_seed: Any) -> None:
    """``rw.Loader(dataloader, per_device_batch_size=, num_replicas=, replicas_in_process=)``."""
    if not isinstance(dataloader, DataLoader):
        validate.fail("dataloader", dataloader, "a torch DataLoader", where="rw.Loader()",
                      fix="build loaders with rw.loader(dataset, batch_size=...), which makes "
                      "the DataLoader and the rw.Loader.")  # fmt: skip
    for name, value in sizes.items():
        validate.integer(name, value, minimum=1, where="rw.Loader()")
    validate.integer("generator_seed", generator_seed, optional=True, where="rw.Loader()")


def _check_positive(name: str, value: Any, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{name}={value!r} must be a positive integer", fix=f"pass e.g. {name}={example}."
        )


def _nearest(value: int, replicas: int) -> str:
    below = value // replicas * replicas
    above = below + replicas
    choices = [v for v in (below, above) if v > 0]
    return " or ".join(f"{v} ({v // replicas} per device)" for v in choices)
