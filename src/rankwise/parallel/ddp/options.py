"""torch's ``DistributedDataParallel`` arguments that need more than storing.

Every argument of torch 2.13's constructor is accepted. Most keep their meaning; these are
interpreted here (docs/ddp.md has the table):

- ``broadcast_buffers`` / ``forward_sync_buffers``: torch's rules for syncing buffers in
  forward and at construction;
- ``device_mesh``: a 1-D mesh stands for its process group;
- ``mixed_precision``, ``delay_all_reduce_named_params``/``param_to_hook_all_reduce`` and
  ``bucket_cap_mb_list`` are refused with the alternative; ``check_reduction`` is deprecated
  in torch and warns, as there.
"""

from __future__ import annotations

import warnings
from typing import Any

from ... import validate
from ...errors import ConfigError, ModelError
from .compression import wire_dtype


def check_args(
    module: Any, device_ids: Any, output_device: Any, dim: Any, process_group: Any,
    bucket_cap_mb: Any, compression: Any,
) -> None:
    """The arguments torch's constructor would trip over later (an ``AttributeError`` from
    inside, a device string parsed deep in C++), refused first as ``ConfigError``s naming
    them (a ``ValueError``, the class torch raises for a bad ``device_ids``)."""
    where = "DistributedDataParallel()"
    validate.module("module", module, where=where)
    if device_ids is not None:
        validate.sequence("device_ids", device_ids, "a list of devices or None", where=where,
                          example="[local_rank]")  # fmt: skip
        for i, d in enumerate(device_ids):
            validate.device_name(f"device_ids[{i}]", d, where=where)
    validate.device_name("output_device", output_device, where=where)
    validate.integer("dim", dim, where=where)
    validate.process_group("process_group", process_group, where=where)
    validate.number("bucket_cap_mb", bucket_cap_mb, positive=True, optional=True, where=where,
                    example=25)  # fmt: skip
    wire_dtype(compression)  # a bad compression name is refused before any collective


def refuse_unsupported(
    delay_all_reduce_named_params: Any,
    param_to_hook_all_reduce: Any,
    mixed_precision: Any,
    bucket_cap_mb_list: Any,
    check_reduction: bool,
) -> None:
    """Raise for the torch arguments this engine does not implement; warn for deprecated ones."""
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ConfigError(
            "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the "
            "same time",
            fix="pass both, or neither.",
        )
    if delay_all_reduce_named_params is not None:
        raise ConfigError(
            "delay_all_reduce_named_params is not supported by rankwise's "
            "DistributedDataParallel",
            fix="leave it unset: every bucket's all-reduce already overlaps backward; tune "
            "bucket_cap_mb instead.",
        )
    if mixed_precision is not None:
        raise ConfigError(
            f"mixed_precision={mixed_precision!r} is not supported by rankwise's "
            "DistributedDataParallel",
            fix="run the forward under torch.autocast(...) for low-precision compute, and pass "
            "compression='bf16' (or 'fp16') to send gradients in half precision.",
        )
    if bucket_cap_mb_list is not None:
        raise ConfigError(
            f"bucket_cap_mb_list={bucket_cap_mb_list!r} is not supported",
            fix="pass one bucket_cap_mb (the first bucket is 1 MiB, as in torch).",
        )
    if check_reduction:
        warnings.warn(
            "The `check_reduction` argument of DistributedDataParallel is deprecated (in torch "
            "as well) and has no effect",
            FutureWarning,
            stacklevel=3,
        )


def group_from_mesh(process_group: Any, device_mesh: Any) -> Any:
    """The process group to use: ``process_group``, or the group of a 1-D ``device_mesh``."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise ModelError(
            "Cannot specify both process_group and device_mesh arguments",
            fix="pass one of them.",
        )
    if device_mesh.ndim != 1:
        raise ModelError(
            f"Only 1D device mesh is supported, but got {device_mesh}",
            fix="pass the mesh's data-parallel dimension, e.g. device_mesh['dp'].",
        )
    return device_mesh.get_group(mesh_dim=0)


def buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple:
    """(sync buffers in every forward, sync them at construction): torch's rules.

    ``forward_sync_buffers`` wins when given (and construction always syncs); otherwise
    ``broadcast_buffers`` (default True) decides both.
    """
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    effective = True if broadcast_buffers is None else bool(broadcast_buffers)
    return effective, effective
