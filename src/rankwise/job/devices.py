"""Device names given by users, checked once, with errors that list what this machine has.

DataParallel's ``device_ids``, the pipeline's stages, the session's ``devices=`` all go through
``resolve_device``: an int is an accelerator index (-1 the CPU), a name is a torch device name,
and a device this process cannot see is refused with the devices it can.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError

DeviceLike = torch.device | str | int


def accelerator() -> torch.device | None:
    """The accelerator type of this process (cuda, ...), or None on a CPU-only machine."""
    acc = torch.accelerator.current_accelerator()
    return acc if acc is not None and torch.accelerator.is_available() else None


def resolve_device(device: DeviceLike, what: str) -> torch.device:
    """A full device that exists here: ``cuda`` -> ``cuda:<current>``, 3 -> ``cuda:3``, -1 -> CPU.

    ``what`` names the argument in errors (``device_ids[1]``).
    """
    if isinstance(device, int) and not isinstance(device, bool):
        if device == -1:
            return torch.device("cpu")
        acc = accelerator()
        if acc is None:
            raise ConfigError(
                f"{what}={device!r} names accelerator device {device}, but no accelerator "
                "(CUDA, ...) is available in this process",
                fix="use device_ids=['cpu', 'cpu'] for CPU replicas (threads on the CPU), or "
                "run on a machine with GPUs",
            )
        device = torch.device(acc.type, device)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"{what}={device!r} is not a device name",
            fix="pass ints (accelerator indices) or names like 'cpu', 'cuda:0', 'cuda:1'.",
        ) from exc
    if dev.type == "cpu":
        return torch.device("cpu")  # 'cpu:0' and 'cpu' are the same device
    backend = getattr(torch, dev.type, None)
    count = backend.device_count() if backend and hasattr(backend, "device_count") else 0
    if dev.index is None and count > 0:
        dev = torch.device(dev.type, backend.current_device())
    if count == 0 or dev.index >= count:
        have = ", ".join(f"{dev.type}:{i}" for i in range(count)) or f"no {dev.type} device"
        raise ConfigError(
            f"{what}={device!r} does not exist: this machine has {count} {dev.type} "
            f"device(s) ({have})",
            fix=f"use devices among: {have}; or 'cpu' to run without accelerators "
            "(check CUDA_VISIBLE_DEVICES if you expected more).",
        )
    return dev
