"""Which strategy this process runs: 'auto' resolved, refused combinations named with the fix.

Part of the ground floor: ``rw.init`` settles the plan before it joins the job, so a refused
strategy fails every rank at once, before the rendezvous. Imports nothing above ``runtime``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ..errors import ConfigError, RuntimeStateError
from ..strategies import AUTO, resolve_auto
from ..strategies import get as get_strategy
from ..validate import device_name, fail, text
from ..validate import timeout as check_timeout
from .devices import resolve_device
from .env import DEFAULT_TIMEOUT_S, DistEnv

_LAUNCHER_FIX = (
    "use strategy='ddp' (or 'auto') when launched with several processes, or start the script "
    "with plain `python train.py` for one process."
)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What ``rw.init`` settles before it joins the job."""

    strategy: str
    """A name of ``rankwise.strategies.STRATEGIES`` ('auto' resolved)."""
    devices: tuple[torch.device, ...] = ()
    """DataParallel's devices under 'dp' (the first is the master); empty otherwise."""
    auto: bool = False
    """True when 'auto' chose ``strategy``: ``rt.prepare`` may still move a multi-process
    run from 'ddp' to the ZeRO stage the model fits in (``rankwise.session.auto``)."""


def _accelerator_count() -> int:
    acc = torch.accelerator.current_accelerator()
    return torch.accelerator.device_count() if acc is not None else 0


BACKENDS = ("gloo", "nccl", "mpi")
"""The process-group backends ``rw.init(backend=...)`` takes (per device: 'cpu:gloo,cuda:nccl')."""


def check_init_arguments(backend: Any, device: Any, timeout: Any, env: Any) -> None:
    """``rw.init``'s arguments by type (``rankwise.validate``), on every rank before anything is joined
    (a backend's availability is checked where the process group is made)."""
    text("backend", backend, optional=True, where="rw.init()")
    if backend is not None and any(p.split(":")[-1] not in BACKENDS for p in backend.split(",")):
        fail("backend", backend, f"one of {', '.join(map(repr, BACKENDS))} (or per device, "
             "'cpu:gloo,cuda:nccl')", where="rw.init()",
             fix="use 'nccl' for GPUs and 'gloo' for CPUs, or leave backend unset.")  # fmt: skip
    device_name("device", device, where="rw.init()")
    check_timeout("timeout", timeout, where="rw.init()")
    if env is not None and not isinstance(env, DistEnv):
        fail("env", env, "a rw.DistEnv or None", where="rw.init()", fix="leave env unset (read "
             "from the launcher), or pass rw.DistEnv(rank=..., world_size=...).")  # fmt: skip


def plan(strategy: str | None, devices: Sequence[Any] | None, env: DistEnv, device: Any) -> Plan:
    """Resolve ``strategy`` ('auto' included) for this process; errors say the fix.

    'auto' (``rankwise.strategies.resolve_auto``): launched with world size > 1 -> 'ddp'
    (``rt.prepare`` may move to a ZeRO stage); unlaunched with ``devices=`` or several GPUs
    (and no explicit ``device=``) -> 'dp'; otherwise 'single'. No sync point.
    """
    name = AUTO if strategy is None else strategy
    spec = None if name == AUTO else get_strategy(name)  # raises the bad-name error
    if devices is not None and spec is not None and not spec.splits_batch_in_process:
        raise ConfigError(
            f"devices={list(devices)!r} lists DataParallel's devices, but strategy={name!r} "
            "computes on one device per process (rt.device)",
            fix="drop devices=, or use strategy='dp' to split each batch over those devices.",
        )
    if spec is None:
        several = devices is not None or (device is None and _accelerator_count() > 1)
        spec = resolve_auto(env.world_size, devices_given=devices is not None, several=several)
    if not spec.multi_process and env.world_size > 1:
        raise ConfigError(
            f"strategy={spec.name!r} runs one process, but this process is rank {env.rank} of "
            f"WORLD_SIZE={env.world_size} (from {env.source})",
            fix=_LAUNCHER_FIX,
            rank=env.rank,
        )
    if not spec.splits_batch_in_process:  # 'auto' may still shard a multi-process run
        return Plan(strategy=spec.name, auto=name == AUTO and spec.multi_process)
    return Plan(strategy=spec.name, devices=_dp_devices(devices, device))


def _dp_devices(devices: Sequence[Any] | None, device: Any) -> tuple[torch.device, ...]:
    if devices is None:
        count = _accelerator_count()
        if count == 0:
            raise ConfigError(
                "strategy='dp' was asked for on a machine without GPUs, and devices= was not given",
                fix="pass devices=['cpu', 'cpu'] for two CPU replicas (threads in this process), "
                "or use strategy='single'.",
            )
        acc = torch.accelerator.current_accelerator()
        devices = [torch.device(acc.type, i) for i in range(count)]
    if isinstance(devices, (str, int, torch.device)) or len(devices) == 0:
        raise ConfigError(
            f"devices={devices!r} must be a non-empty list of devices",
            fix="pass e.g. devices=[0, 1] or devices=['cpu', 'cpu'].",
        )
    resolved = tuple(resolve_device(d, f"devices[{i}]") for i, d in enumerate(devices))
    if device is not None and resolve_device(device, "device") != resolved[0]:
        raise ConfigError(
            f"device={device!r} differs from devices[0]={devices[0]!r}, DataParallel's master",
            fix="drop device= (strategy='dp' computes on devices[0]), or list it first in devices.",
        )
    return resolved


def check_same(
    current: Plan, env: DistEnv, strategy: str | None, devices: Sequence[Any] | None
) -> None:
    """A second ``rw.init`` may repeat the strategy (or say 'auto'), not ask for another one.

    ``current``: the runtime's strategy and devices; ``env``: its place in the job."""
    if strategy in (None, AUTO) and devices is None:
        return
    if devices is None:  # a named strategy: compare names ('dp' alone means "the same devices")
        asked = Plan(strategy=get_strategy(strategy).name)  # a bad name raises its error
    else:
        asked = plan(strategy, devices, env, None)
    if asked.strategy != current.strategy:
        key, have, want = "strategy", current.strategy, asked.strategy
    elif devices is not None and asked.devices != current.devices:
        key, have, want = "devices", _names(current.devices), _names(asked.devices)
    else:
        return
    raise RuntimeStateError(
        f"rw.init() was already called with {key}={have}; this call asks for {key}={want}",
        fix="call rw.init() once at the start of the program (later calls return the same "
        "runtime), or rw.shutdown() first to start over with other settings.",
        rank=env.rank,
    )


def _names(devices: Sequence[torch.device]) -> str:
    return "[" + ", ".join(f"'{d}'" for d in devices) + "]"


def as_timeout(timeout: float | timedelta | None) -> timedelta:
    """``rw.init``'s timeout as a ``timedelta`` (None: the default); positive or refused."""
    if timeout is None:
        return timedelta(seconds=DEFAULT_TIMEOUT_S)
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if seconds <= 0:
        raise ConfigError(
            f"timeout={timeout!r} must be positive",
            fix="pass a timeout in seconds, e.g. rw.init(timeout=300).",
        )
    return timedelta(seconds=seconds)


def check_same_settings(current: Any, backend: str | None, device, timeout) -> None:
    """A second ``rw.init`` may repeat backend, device and timeout, not ask for others.

    ``current``: the runtime (backend, device, timeout, rank)."""
    asked = {
        "backend": None if backend is None else backend,
        "device": None if device is None else torch.device(device),
        "timeout": None if timeout is None else as_timeout(timeout),
    }
    have = {"backend": current.backend, "device": current.device, "timeout": current.timeout}
    for key, value in asked.items():
        if value is None or value == have[key] or have[key] is None:
            continue
        if key == "device" and value.type == have[key].type and value.index is None:
            continue
        raise RuntimeStateError(
            f"rw.init() was already called with {key}={have[key]!s}; "
            f"this call asks for {key}={value!s}",
            fix="call rw.init() once at the start of the program (later calls return the same "
            "runtime), or rw.shutdown() first to start over with other settings.",
            rank=current.rank,
        )


def check_same_precision(current: Any, precision: str | None) -> None:
    if precision is not None and parse(precision).name != current.precision:
        raise RuntimeStateError(
            f"rw.init() was already called with precision={current.precision!r}; this call "
            f"asks for precision={parse(precision).name!r}",
            fix="call rw.init() once at the start of the program, or rw.shutdown() first.",
            rank=current.rank,
        )


# ---- precision: how the prepared model computes (applied by rankwise.training.precision) ----

PRECISIONS = ("32", "bf16-mixed", "fp16-mixed", "bf16-true")
_ALIASES = {"32-true": "32", "fp32": "32", "bf16": "bf16-mixed", "16-mixed": "fp16-mixed"}


@dataclass(frozen=True, kw_only=True)
class Precision:
    """How the forward computes and whether the loss is scaled."""

    name: str = "32"
    """One of ``PRECISIONS``: '32', 'bf16-mixed', 'fp16-mixed' or 'bf16-true'."""

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ConfigError(
                f"precision={self.name!r} is not one of {', '.join(map(repr, PRECISIONS))}",
                fix="pass precision='bf16-mixed' (CPU and recent GPUs), 'fp16-mixed' (GPUs, "
                "with a loss scaler), 'bf16-true' (bf16 weights) or '32' (the default).",
            )

    @property
    def mixed(self) -> bool:
        return self.name.endswith("-mixed")

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of the forward."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name[:4], torch.float32)

    @property
    def scales_loss(self) -> bool:
        return self.name == "fp16-mixed"

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """``torch.autocast`` for a mixed policy, a no-op context otherwise."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.dtype)


def parse(precision: str | int | Precision | None) -> Precision:
    """``Precision`` from a name ('bf16-mixed', ...), a few common aliases, or 32/None."""
    if isinstance(precision, Precision):
        return precision
    if precision is None:
        return Precision()
    name = str(precision)
    return Precision(name=_ALIASES.get(name, name))
