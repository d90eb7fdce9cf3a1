"""The fingerprints' process-wide state, in one object: ``STATE``.

torch's process groups are process-global, so the record of what was issued on them is too.
Everything that used to be a module global (settings, groups, the watched world group, its side
channel and watchdog, the signature cache, the latest diagnosis) is a field here, so a reader
sees all of it in one place and ``reset()`` clears all of it.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ... import runtime
from ...job import env as envmod
from ..channel import sidechannel
from .settings import Settings


class Group:
    """Sequence numbers, rolling hash and history of one process group."""

    def __init__(self, pg: Any, name: str, channel: sidechannel.Channel, history: int) -> None:
        self.pg, self.name, self.channel = pg, name, channel
        self.size, self.rank = pg.size(), pg.rank()
        self.ranks = dist.get_process_group_ranks(pg)
        self.global_rank = self.ranks[self.rank]
        self.key_last = sidechannel.key_last(name, self.global_rank)
        self.seq, self.rolling = 0, 0
        # The latest ``entry.Entry`` objects (that module reads ``STATE``: it is named there).
        self.ring: deque[Any] = deque(maxlen=history)
        backend = str(dist.get_backend(pg))
        self.gloo = "gloo" in backend
        cuda = "nccl" in backend and not self.gloo
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else None


@dataclass
class State:
    """What this process knows about the collectives it issued."""

    settings: Settings = field(
        default_factory=lambda: Settings(enabled=envmod.fingerprints_enabled())
    )
    groups: dict[int, Group] = field(default_factory=dict)
    """Per process group (by ``id``), its sequence, rolling hash and ring of entries."""
    world: Any = None
    """The default process group the side channel and watchdog belong to."""
    channel: sidechannel.Channel | None = None
    """The rendezvous store, used as a side channel that works while a collective is stuck."""
    watchdog: sidechannel.Watchdog | None = None
    signatures: dict[tuple, tuple[str, int]] = field(default_factory=dict)
    """Cache: (op, extra, dtypes and shapes) -> (printed signature, its CRC)."""
    last_report: str | None = None
    """The latest diagnosis made on this rank (a failure, or the watchdog's stuck report)."""
    hooks_registered: bool = False
    """``reset`` is registered with ``atexit`` and ``runtime.on_shutdown`` (done once)."""
    blocked: list[Any] | None = None
    """``[what, since]`` while the main thread waits on a transfer that is no collective (a
    pipeline stage's receive): published in the heartbeat, so that a stall report elsewhere
    knows this rank waits too (``stall.blocked_elsewhere``)."""

    def timeout_s(self) -> float:
        if runtime.is_initialized():
            return runtime.get_runtime().timeout.total_seconds()
        return c10d.default_pg_timeout.total_seconds()

    def interval(self) -> float:
        """The watchdog's period: the setting, capped at a tenth of the timeout."""
        return max(0.05, min(self.settings.heartbeat_s, self.timeout_s() / 10))

    def reset(self) -> None:
        """Forget all groups; stop AND join the watchdog (also at exit: a daemon thread killed
        inside a store call at finalisation aborts the process with SIGABRT)."""
        wd = self.watchdog
        if wd is not None:
            wd.stopped.set()
            if wd.is_alive() and wd is not threading.current_thread():
                wd.join(timeout=10)
        self.groups.clear()
        self.world = self.channel = self.watchdog = None


STATE = State()
"""The one instance: torch's process groups are per process, and so is their record."""
