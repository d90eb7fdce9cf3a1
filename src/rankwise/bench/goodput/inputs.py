"""What the goodput model is given: how often devices fail, and what a recovery costs.

``Failures`` holds the published failure rate (Meta's Llama 3 405B pre-training, below);
``Costs`` the per-phase costs of a recovery, as this project measures them (the namespace
cluster, benchmarks/goodput.py); ``Scenario`` one job: its size, checkpoint, storage, intervals.
Every value is checked at construction, and a wrong one is named with its fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ...errors import ConfigError

DAY_S = 86_400.0

# "The Llama 3 Herd of Models" (Meta, arXiv:2407.21783), section 3.3.4 and its Table 5: a
# 54-day snapshot of the 405B pre-training on 16,384 H100 GPUs saw 466 job interruptions, 47
# planned and 419 unexpected (about one every 3 hours); about 78% of the unexpected ones were
# confirmed or suspected hardware issues (a host to replace), the rest software and the like.
LLAMA3_UNEXPECTED = 419
LLAMA3_DAYS = 54.0
LLAMA3_GPUS = 16_384
LLAMA3_HARDWARE_FRACTION = 0.78
LLAMA3_CAUSES = {  # the largest rows of its Table 5 (count of the 419)
    "faulty GPU": 148,
    "GPU HBM3 memory": 72,
    "software bug": 54,
    "network switch/cable": 35,
    "host maintenance": 32,
    "GPU SRAM memory": 19,
    "GPU system processor": 17,
}

# This project's restart from disk, measured on the namespace cluster (3 hosts x 1 process,
# the median phases of benchmarks/results/goodput.json#inputs/phases_median, on a loaded
# machine), as ``Costs`` fields: the defaults of ``rankwise bench goodput``.
MEASURED_RESTART = {"detect_s": 15.2, "restart_s": 6.0, "rendezvous_s": 5.2,
                    "load_fixed_s": 2.9, "save_fixed_s": 0.07, "warmup_s": 0.05}  # fmt: skip
# Until the in-memory recovery is measured: issue 45's targets (3% of a step added when
# replicating every step, a 15 s grow-back) and a replacement host ready in 5 minutes.
# The survivors re-form in the measured detection of a lost host (3.9 s:
# benchmarks/results/faults_cluster.json, node_killed) plus the rendezvous.
ASSUMED = {"replication_overhead": 0.03, "grow_back_s": 15.0, "replace_s": 300.0,
           "reform_s": 3.9 + 5.2}  # fmt: skip


def _check(owner: str, name: str, value: float, *, low: float = 0.0, strict: bool = False,
           high: float = math.inf) -> None:  # fmt: skip
    bad = not math.isfinite(value) if high == math.inf else math.isnan(value)
    bad = bad or (value <= low if strict else value < low) or value > high
    if bad:
        bound = f"> {low}" if strict else f">= {low}"
        bound += "" if high == math.inf else f" and <= {high}"
        raise ConfigError(
            f"goodput {owner}.{name} must be a finite number {bound}: got {value!r}",
            fix=f"pass {name}= a value {bound} (seconds, bytes or bytes per second as named)",
        )


@dataclass(frozen=True, kw_only=True)
class Failures:
    """Unexpected interruptions, memoryless (a Poisson process), at a rate per device."""

    device_mtbf_s: float
    """Mean time between failures of one device, seconds: the job's MTBF is this / devices."""
    hardware_fraction: float = LLAMA3_HARDWARE_FRACTION
    """Share of failures that take a host away until a replacement arrives (the rest end
    in a restart on the same hosts)."""

    def __post_init__(self) -> None:
        _check("Failures", "device_mtbf_s", self.device_mtbf_s, strict=True)
        _check("Failures", "hardware_fraction", self.hardware_fraction, high=1.0)

    @classmethod
    def llama3(cls) -> Failures:
        """The Llama 3 405B figure: 419 unexpected interruptions in 54 days on 16,384 GPUs."""
        job_mtbf = LLAMA3_DAYS * DAY_S / LLAMA3_UNEXPECTED
        return cls(device_mtbf_s=job_mtbf * LLAMA3_GPUS)

    def rate(self, devices: int) -> float:
        """Failures per second of a job on ``devices`` devices."""
        return devices / self.device_mtbf_s


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Per-phase costs of a recovery, seconds (measured: benchmarks/results/goodput.json)."""

    detect_s: float
    """From the failure until the restart begins (the survivors notice, the agents stop)."""
    restart_s: float
    """New processes up: spawned, imports done."""
    rendezvous_s: float
    """The rendezvous and the process group formed again."""
    load_fixed_s: float = 0.0
    """Reading a checkpoint back, less its bytes over the bandwidth (model built, file opened)."""
    save_fixed_s: float = 0.0
    """A save's cost besides its bytes over the bandwidth."""
    warmup_s: float = 0.0
    """The first step after a restart, beyond an ordinary step."""
    replace_s: float = 0.0
    """Until a replacement host is ready, after a hardware failure (0: hot spares)."""
    reform_s: float | None = None
    """Shrink-and-continue: survivors back to training at the smaller world, without the
    state's bytes (None: the restart's detect + rendezvous, no process restarted)."""
    grow_back_s: float = 0.0
    """Shrink-and-continue: the pause while a returning host joins."""
    replication_overhead: float = 0.0
    """What one in-memory copy adds, in steps: the time a step takes with a copy every step
    over a plain step, less 1 (0.03: 3% of a step; 1.72: a copy outlasting the step is simply
    a long step). Replicating every K steps adds 1/K of it to each step: speed 1/(1 + it/K)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                _check("Costs", f.name, float(value))

    @property
    def reform(self) -> float:
        return self.detect_s + self.rendezvous_s if self.reform_s is None else self.reform_s


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One job: its size, what it saves and where, and how often."""

    devices: int
    devices_per_host: int = 8
    checkpoint_bytes: float
    """The whole job's state (parameters, optimizer, ...): what a disk save writes."""
    storage_Bps: float
    """Aggregate storage bandwidth, bytes/s, for the whole job's save and load."""
    peer_Bps: float = 50e9
    """One host's network bandwidth, bytes/s, for copying a host's state from a peer."""
    save_interval_s: float
    """Compute time between disk checkpoints."""
    step_s: float = 10.0
    replication_steps: int = 1
    """In-memory replication every this many steps."""
    backup_interval_s: float = 3600.0
    """In-memory policies: compute time between the disk saves they keep as the last line."""

    def __post_init__(self) -> None:
        for name in ("devices", "devices_per_host", "replication_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"goodput Scenario.{name} must be an integer >= 1: got "
                                  f"{value!r}", fix=f"pass {name}= a whole number, e.g. 8")  # fmt: skip
        if self.devices % self.devices_per_host:
            raise ConfigError(
                f"goodput Scenario: devices={self.devices} is not a multiple of "
                f"devices_per_host={self.devices_per_host}",
                fix="pass a whole number of hosts' devices",
            )
        for name in ("checkpoint_bytes",):
            _check("Scenario", name, float(getattr(self, name)))
        for name in ("storage_Bps", "peer_Bps", "save_interval_s", "step_s", "backup_interval_s"):
            _check("Scenario", name, float(getattr(self, name)), strict=True)

    @property
    def hosts(self) -> int:
        return self.devices // self.devices_per_host

    @property
    def host_bytes(self) -> float:
        """One host's share of the state: what a peer copies back in memory recovery."""
        return self.checkpoint_bytes / self.hosts
