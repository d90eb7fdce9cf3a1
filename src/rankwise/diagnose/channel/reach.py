"""Store reads that give up: a node cut off from the store's host must still explain itself.

A TCPStore read waits for the reply with no time limit of its own: on a node that a network
partition cut off from the store's host, the packets vanish, TCP retransmits for a quarter of an
hour, and a diagnosis (or the stall report) that reads the store waited as long, so the job
hung instead of failing at its timeout. Reads here run in a helper thread and are abandoned
after ``READ_TIMEOUT_S``: the caller goes on with what it knows locally and says that the store
did not answer. While an abandoned read is still stuck, later reads give up at once (no pile of
threads); once it returns (the network healed), reads work again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

READ_TIMEOUT_S = 10.0
"""Seconds a store read may take before the store counts as unreachable (a live store answers
in milliseconds, seconds on a very loaded machine)."""


class Unreachable(TimeoutError):
    """The store did not answer within the time limit."""


_CLOSED = ("connection reset", "connection refused", "broken pipe", "connection closed",
           "failed to connect", "got 0 bytes")  # fmt: skip


def closed(exc: BaseException) -> bool:
    """True when ``exc`` says the store's host closed or refused the connection: its process
    is gone (a store that is merely slow or cut off raises ``Unreachable`` instead)."""
    if isinstance(exc, (ConnectionError, EOFError)):
        return True
    text = str(exc).lower()
    return type(exc).__name__ == "DistNetworkError" or any(word in text for word in _CLOSED)


def address(store: Any) -> str | None:
    """'host:port' of the TCPStore behind ``store`` (through PrefixStores), or None."""
    for _ in range(8):
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        if isinstance(host, str) and isinstance(port, int):
            return f"{host}:{port}"
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return None


class BoundedReads:
    """Runs store reads with a time limit; ``unreachable`` names the store while one is stuck."""

    def __init__(self, store: Any, timeout: float = READ_TIMEOUT_S) -> None:
        self.timeout = timeout
        self.where = address(store) or "its address unknown"
        self._stuck: threading.Thread | None = None

    @property
    def unreachable(self) -> str | None:
        """The store's 'host:port' while a read to it is stuck, else None."""
        stuck = self._stuck
        if stuck is not None and not stuck.is_alive():
            self._stuck = stuck = None
        return None if stuck is None else self.where

    def call(self, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        """``fn(*args)``, or ``Unreachable`` after ``timeout`` s (default: the reads' limit;
        the call is left to finish in its thread)."""
        timeout = self.timeout if timeout is None else timeout
        if self.unreachable is not None:
            raise Unreachable(f"the store at {self.where} has not answered an earlier read")
        box: dict[str, Any] = {}

        def read() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # handed to the caller below
                box["error"] = exc

        thread = threading.Thread(target=read, name="rankwise-store-read", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            self._stuck = thread
            raise Unreachable(f"the store at {self.where} did not answer within {timeout:.0f}s")
        if "error" in box:
            raise box["error"]
        return box["value"]
