"""The three ways back from a failure, as one shape (``Plan``) both models read.

- ``disk``: restart from disk. Every process restarts, the state is read back from storage,
  and the work since the last save is lost. A save blocks training for its bytes over the
  storage bandwidth (plus its fixed cost).
- ``memory``: in-memory recovery (Gemini, SOSP'23, style). Every process restarts, but the
  state comes from a peer's RAM, replicated every K steps (each step takes
  ``1 + replication_overhead / K`` times as long: the measured overhead is added time);
  the work since the last replication is lost. Disk saves stay, as the last line, every
  ``backup_interval_s`` (their time added to the overhead; the rare loss of a host and its
  buddy together, which would fall back to them, is not modelled).
- ``shrink``: shrink and continue. The survivors re-form at the smaller world from the
  replicas (no restart, no disk), run at (hosts-1)/hosts of the speed until the host returns
  (a replacement after a hardware failure, the same host after a software one), then pause
  to grow back.

Work is counted in *progress seconds*: time at full speed. A plan repeats segments of ``tau``
seconds of work followed by ``delta`` seconds of blocking save; a failure loses the segment
in progress.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from .inputs import Costs, Failures, Scenario

POLICIES = ("disk", "memory", "shrink")


@dataclass(frozen=True)
class Plan:
    """One policy in numbers. ``recover_s``/``away_s`` are (hardware, software) pairs."""

    name: str
    tau: float
    """Work between durable points (a save, a replication), progress seconds."""
    delta: float
    """A durable point's blocking cost, seconds."""
    overhead: float
    """Wall seconds added to each second of work in steady state (replication, disk saves
    kept as the last line): the speed is ``1 / (1 + overhead)``; any value >= 0 is possible."""
    recover_s: tuple[float, float]
    """Downtime after a (hardware, software) failure: no progress."""
    away_s: tuple[float, float] = (0.0, 0.0)
    """Shrink: how long the failed host stays away after a (hardware, software) failure."""
    grow_back_s: float = 0.0
    hosts: int = 1
    rate: float = 0.0
    """Failures per second of the whole job."""
    hardware_fraction: float = 1.0


def _disk_load(s: Scenario, c: Costs) -> float:
    return c.load_fixed_s + s.checkpoint_bytes / s.storage_Bps


def disk_save_s(s: Scenario, c: Costs) -> float:
    """A blocking disk save: the whole state over the storage bandwidth, plus its fixed cost."""
    return c.save_fixed_s + s.checkpoint_bytes / s.storage_Bps


def _restart(s: Scenario, c: Costs, load: float) -> tuple[float, float]:
    software = c.detect_s + c.restart_s + c.rendezvous_s + load + c.warmup_s
    return software + c.replace_s, software


def plan(policy: str, s: Scenario, c: Costs, f: Failures) -> Plan:
    """The ``Plan`` of ``policy`` ('disk', 'memory' or 'shrink') for this job."""
    common = {"hosts": s.hosts, "rate": f.rate(s.devices), "hardware_fraction": f.hardware_fraction}
    if policy == "disk":
        return Plan("disk", s.save_interval_s, disk_save_s(s, c), 0.0,
                    _restart(s, c, _disk_load(s, c)), **common)  # fmt: skip
    tau = s.replication_steps * s.step_s
    # Both are added time per second of work: a copy every K steps adds its measured cost
    # (in steps) / K to each step, a blocking disk save its seconds to each backup interval
    # of work. They add up: no step (so no copy) runs during a blocking save.
    replication = c.replication_overhead / s.replication_steps
    overhead = replication + disk_save_s(s, c) / s.backup_interval_s
    peer_load = s.host_bytes / s.peer_Bps
    if policy == "memory":
        return Plan("memory", tau, 0.0, overhead, _restart(s, c, peer_load), **common)
    if policy == "shrink":
        reform = c.reform + peer_load + c.warmup_s
        rejoin = c.restart_s + c.rendezvous_s  # a software failure: the same host comes back
        return Plan("shrink", tau, 0.0, overhead, (reform, reform), (c.replace_s, rejoin),
                    c.grow_back_s, **common)  # fmt: skip
    raise ConfigError(f"goodput policy {policy!r} is not one of {', '.join(POLICIES)}",
                      fix=f"pass one of {POLICIES}")  # fmt: skip
