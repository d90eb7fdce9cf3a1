"""Which process group and which device a DistributedDataParallel wrapper works with."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ... import runtime
from ...errors import ConfigError, NoProcessGroupError


def group_size_and_rank(group: dist.ProcessGroup | None, strict: bool = True) -> tuple[int, int]:
    """(world size, rank) of ``group``; (1, 0) when running alone without a process group."""
    if group is not None:
        return dist.get_world_size(group), dist.get_rank(group)
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    env = runtime.coords()
    if env.world_size > 1 and strict:
        raise NoProcessGroupError(
            f"DistributedDataParallel needs a process group: this process is rank {env.rank} "
            f"of WORLD_SIZE={env.world_size} (from {env.source}), but torch.distributed is "
            "not initialised",
            fix="call `rt = rw.init()` at the start of the program, before wrapping the model.",
            rank=env.rank,
        )
    return 1, 0


def check_devices(
    module: nn.Module,
    device_ids: Sequence[int | torch.device] | None,
    output_device: int | torch.device | None,
    rank: int,
) -> tuple[list[torch.device] | None, torch.device | None]:
    devices = {t.device for t in module.parameters()} | {t.device for t in module.buffers()}
    if device_ids is None:
        return None, None if output_device is None else _as_device(output_device)
    ids = [_as_device(d) for d in device_ids]
    shown = sorted(str(d) for d in devices)
    if len(ids) != 1:
        raise ConfigError(
            f"device_ids={list(device_ids)!r} names {len(ids)} devices; DistributedDataParallel "
            "drives one device per process",
            fix="pass device_ids=[local_rank] (one process per device), or device_ids=None for "
            "a module that spans several devices.",
            rank=rank,
        )
    if len(devices) > 1:
        raise ConfigError(
            f"the module spans devices {shown} but device_ids={list(device_ids)!r}",
            fix="pass device_ids=None for a module split over several devices.",
            rank=rank,
        )
    if devices and devices != {ids[0]}:
        raise ConfigError(
            f"the module's parameters are on {shown[0]} but device_ids={list(device_ids)!r} "
            f"asks for {ids[0]}",
            fix=f"move the model to {_fix_device(ids[0])} (or rt.device) before wrapping: "
            "model = Net().to(rt.device); DistributedDataParallel(model, "
            "device_ids=[rt.local_rank]).",
            rank=rank,
        )
    out = ids[0] if output_device is None else _as_device(output_device)
    return ids, out


def _fix_device(device: torch.device) -> str:
    return "cuda:K" if device.type == "cuda" else str(device)


def _as_device(d: int | str | torch.device) -> torch.device:
    if isinstance(d, int):
        return torch.device("cuda", d)
    dev = torch.device(d)
    if dev.type == "cuda" and dev.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return torch.device("cuda", index)
    return dev
