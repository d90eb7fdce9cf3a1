"""torch's c10d rendezvous handler, with the calls a cut-off node could hang in given a limit.

Between machines, the c10d handler talks to its store on the endpoint's node while the job
runs: the agent asks it every monitoring tick whether a node waits to join, and closes it at
the end. On a node that a network partition cut off from that node, such a call never gets an
answer (TCP retransmits for a quarter of an hour): the agent stopped watching its workers, and
the node's launcher hung long after they had failed at their timeout. Here those calls give up
(``diagnose.reach``, the diagnosis's own store reads): "no node waits" while the store does not
answer, the rendezvous closed as far as this node can, and a new round that cannot complete
fails after --rdzv-timeout like one that never met.
"""

from __future__ import annotations

from typing import Any

from ...diagnose.channel.reach import READ_TIMEOUT_S, BoundedReads, Unreachable
from .signed import BACKEND


class GuardedHandler:
    """A proxy for torch's ``RendezvousHandler`` (everything else passes through)."""

    def __init__(self, handler: Any, rdzv_timeout: float) -> None:
        self._handler = handler
        self._rdzv_timeout = rdzv_timeout
        self._calls = BoundedReads(None, READ_TIMEOUT_S)
        self._rounds = BoundedReads(None, rdzv_timeout + 30)  # a round may wait that long

    def __getattr__(self, name: str) -> Any:  # torch's object: forward what is not bounded
        return getattr(self._handler, name)

    def num_nodes_waiting(self) -> int:
        from torch.distributed import DistError

        try:
            return self._calls.call(self._handler.num_nodes_waiting)
        except Unreachable:
            return 0  # cut off from the store: no node can join this one now
        except (DistError, OSError):
            # the store's node closed the connection: at the job's end its launcher may leave
            # while this node's workers still finish (seen in the fault matrix: every rank
            # done, this launcher exit 1 "could not complete the c10d rendezvous"). No node
            # can join through a closed store; if the job still needed it, its workers fail
            # on their own and that failure is reported, not this read
            return 0

    def shutdown(self) -> bool:
        from torch.distributed import DistError

        try:
            return self._calls.call(self._handler.shutdown)
        except Unreachable:
            return False
        except (DistError, OSError):
            # torch closes the rendezvous after the job, through the store on the endpoint's
            # node; when that node's launcher ended first (its exit barrier saw every node
            # finish), the store is gone and torch re-raises the closed connection: the job
            # still succeeded, and a closed rendezvous is what shutdown wanted anyway
            return False

    def next_rendezvous(self) -> Any:
        from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

        try:
            return self._rounds.call(self._handler.next_rendezvous)
        except Unreachable:
            raise RendezvousTimeoutError(
                f"the rendezvous round did not end within --rdzv-timeout={self._rdzv_timeout:.0f}s"
                " (+30 s), and torch's own limit did not fire either: the store on the endpoint's "
                "node stopped answering (this node is cut off from it, or that node is down)"
            ) from None


def guard(handler: Any, rdzv_timeout: float) -> Any:
    """``handler`` with its store calls bounded, for the c10d backends (static's do not wait)."""
    backend = getattr(handler, "get_backend", lambda: "")()
    waits = backend in ("c10d", BACKEND)  # torch's, or the signed one rankwise registers
    return GuardedHandler(handler, rdzv_timeout) if waits else handler
