"""The rank table: which process is which, on N nodes x M devices (e.g. 3 x 4).

Global rank = node_rank * nproc_per_node + local_rank. Node 0 / rank 0 is the master: it hosts
the rendezvous store and is the process that prints, logs and saves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Slot:
    """One process of the job."""

    node: int
    """Machine index (node_rank)."""
    rank: int
    """Global rank."""
    local_rank: int
    """Device index on its machine."""
    is_master: bool
    """True for global rank 0."""


@dataclass(frozen=True, kw_only=True)
class Topology:
    """All processes of a job of ``nnodes`` machines with ``nproc_per_node`` processes each."""

    nnodes: int
    nproc_per_node: int

    def __post_init__(self) -> None:
        for name, value in (("nnodes", self.nnodes), ("nproc_per_node", self.nproc_per_node)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"{name}={value!r} must be a positive whole number",
                    fix=f"pass {name} >= 1, e.g. --{name.replace('_', '-')} 1.",
                )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def slots(self) -> list[Slot]:
        return [
            Slot(node=n, rank=n * self.nproc_per_node + lr, local_rank=lr, is_master=n == lr == 0)
            for n in range(self.nnodes)
            for lr in range(self.nproc_per_node)
        ]

    def slot(self, rank: int) -> Slot:
        """The slot of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(
                f"rank={rank} is out of range for world size {self.world_size}",
                fix=f"ranks run from 0 to {self.world_size - 1}.",
            )
        return self.slots[rank]

    def to_dict(self) -> dict:
        return {
            "nnodes": self.nnodes,
            "nproc_per_node": self.nproc_per_node,
            "world_size": self.world_size,
            "slots": [asdict(s) for s in self.slots],
        }

    def format(self) -> str:
        """A human-readable table, one line per process, the master marked."""
        lines = [
            f"world size {self.world_size} = {self.nnodes} node(s) x "
            f"{self.nproc_per_node} process(es) per node",
            f"{'node':>4}  {'rank':>4}  {'local_rank':>10}",
        ]
        for s in self.slots:
            mark = "  <- master (node 0, rank 0)" if s.is_master else ""
            lines.append(f"{s.node:>4}  {s.rank:>4}  {s.local_rank:>10}{mark}")
        return "\n".join(lines)
