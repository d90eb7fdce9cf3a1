"""How collectives are recorded and checked: one frozen ``Settings`` (``configure`` replaces it)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Settings:
    """How collectives are recorded and checked (``configure`` changes them)."""

    enabled: bool = True
    """Record and publish collectives; off means no recording, no checks, no watchdog."""
    checks: bool = True
    """All-gather fingerprints before checked collectives (first N, every N-th, check=True)."""
    check_first: int = 32
    """Check each of the first N collectives of a group (start-up: broadcasts, first steps)."""
    check_every: int = 256
    """Afterwards check every N-th collective (0: never); one check covers all earlier ones."""
    history: int = 256
    """Entries kept per group (the ring buffer)."""
    heartbeat_s: float = 1.0
    """Watchdog period in seconds (capped at a tenth of the timeout)."""

    def __post_init__(self) -> None:
        for name in ("check_first", "check_every", "history"):
            if getattr(self, name) < (1 if name == "history" else 0):
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} is out of range",
                    fix=f"pass {name} >= {1 if name == 'history' else 0}.",
                )
        if self.heartbeat_s <= 0:
            raise ConfigError(
                f"heartbeat_s={self.heartbeat_s!r} must be positive", fix="e.g. heartbeat_s=1.0."
            )
