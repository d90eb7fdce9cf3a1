"""One device mesh for every kind of parallelism: which rank is which (pipeline, data, tensor).

    mesh = rw.init_mesh({"data": 2, "tensor": 2})        # after rw.init(); world size 4
    model = rw.tensor_parallel(model, plan, group=mesh.group("tensor"))
    model = rw.DistributedDataParallel(model, process_group=mesh.group("data"))

Ranks are laid out with ``tensor`` innermost, then ``data``, then ``pipeline``:

    rank = (pipeline * D + data) * T + tensor

so a tensor-parallel group is ``T`` consecutive ranks: on one machine whenever ``T`` divides
the processes per node (tensor parallelism talks twice per layer and needs the fastest link),
data-parallel groups stride across machines (one all-reduce per step), and pipeline stages are
the farthest apart (one activation per micro-batch crosses). Megatron-LM orders its groups the
same way.

The layout is pure (``DeviceMesh``: ``rankwise topology --mesh data=2,tensor=2`` prints it
without torch); ``init_mesh`` creates the process groups, every group on every rank in the same
order (torch's rule for ``new_group``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import product
from typing import Any

from .. import validate
from ..errors import ConfigError, RuntimeStateError

DIMS = ("pipeline", "data", "tensor")
"""The mesh's dimensions, outermost first."""

__all__ = ["DIMS", "DeviceMesh", "check_same", "create_groups", "init_mesh", "layout", "parse_mesh"]


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,tensor=2"`` -> ``{"data": 2, "tensor": 2}`` (the CLI's spelling)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        if not eq or not value.strip().isdigit():
            raise ConfigError(
                f"mesh entry {part!r} in {text!r} is not NAME=SIZE",
                fix="write the mesh as e.g. --mesh data=2,tensor=2 (names: "
                + ", ".join(DIMS)
                + ").",
            )
        sizes[name.strip()] = int(value)
    return sizes


@dataclass(frozen=True)
class DeviceMesh:
    """The layout of ``world_size`` ranks over the named dimensions (missing ones are size 1).

    ``group(dim)`` is this rank's process group along ``dim``, once ``init_mesh`` made them.
    """

    sizes: Mapping[str, int]
    """Size of each dimension: 'pipeline', 'data', 'tensor'; their product is the world size."""
    rank: int = 0
    """This process's global rank."""
    _groups: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        validate.mapping("sizes", self.sizes, "a mapping of dimension names to sizes",
                         where="DeviceMesh()", example='{"data": 2, "tensor": 2}')  # fmt: skip
        validate.integer("rank", self.rank, minimum=0, where="DeviceMesh()")
        unknown = [name for name in self.sizes if name not in DIMS]
        bad = {k: v for k, v in self.sizes.items() if not isinstance(v, int) or v < 1}
        if unknown or bad:
            raise ConfigError(
                f"mesh {dict(self.sizes)}: "
                + (f"unknown dimension(s) {unknown}" if unknown else f"sizes {bad} must be >= 1"),
                fix='name dimensions among "pipeline", "data", "tensor" with whole sizes >= 1, '
                'e.g. {"data": 2, "tensor": 2}.',
            )
        object.__setattr__(self, "sizes", {d: self.sizes.get(d, 1) for d in DIMS})
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"rank {self.rank} is outside the mesh {self.describe()} of {self.world_size} ranks",
                fix="make the mesh's sizes multiply to the world size.",
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[d] for d in DIMS)

    @property
    def world_size(self) -> int:
        total = 1
        for size in self.shape:
            total *= size
        return total

    def describe(self) -> str:
        return " x ".join(f"{d} {self.sizes[d]}" for d in DIMS if self.sizes[d] > 1) or "1 rank"

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """``{"pipeline": p, "data": d, "tensor": t}`` of ``rank`` (default: this one)."""
        rest = self.rank if rank is None else rank
        out = {}
        for dim in reversed(DIMS):
            rest, out[dim] = divmod(rest, self.sizes[dim])
        return {d: out[d] for d in DIMS}

    def coord(self, dim: str) -> int:
        """This rank's coordinate along ``dim``."""
        return self.coords()[self._dim(dim)]

    def rank_at(self, **coords: int) -> int:
        """The global rank at these coordinates (missing ones 0)."""
        rank = 0
        for dim in DIMS:
            rank = rank * self.sizes[dim] + coords.get(dim, 0)
        return rank

    def all_groups(self, dim: str) -> list[list[int]]:
        """Every group of ranks along ``dim`` (the other coordinates fixed), in creation order."""
        others = [d for d in DIMS if d != self._dim(dim)]
        return [
            [self.rank_at(**dict(zip(others, fixed, strict=True)), **{dim: i})
             for i in range(self.sizes[dim])]
            for fixed in product(*(range(self.sizes[d]) for d in others))
        ]  # fmt: skip

    def ranks(self, dim: str) -> list[int]:
        """The ranks of this rank's group along ``dim``."""
        return next(g for g in self.all_groups(dim) if self.rank in g)

    def group(self, dim: str) -> Any:
        """This rank's ``torch.distributed`` group along ``dim`` (``None`` at world size 1:
        every collective is then local)."""
        dim = self._dim(dim)
        if self.world_size == 1:
            return None
        if dim not in self._groups:
            raise ConfigError(
                f"the mesh {self.describe()} has no process groups yet",
                fix="make the mesh with rw.init_mesh(sizes) (on every rank), not DeviceMesh(...).",
                rank=self.rank,
            )
        return self._groups[dim]

    def _dim(self, dim: str) -> str:
        if dim not in DIMS:
            raise ConfigError(
                f"mesh dimension {dim!r} is not one of {', '.join(DIMS)}",
                fix='ask for mesh.group("data"), mesh.group("tensor") or mesh.group("pipeline").',
            )
        return dim

    def to_dict(self) -> dict[str, Any]:
        return {
            "sizes": dict(self.sizes),
            "world_size": self.world_size,
            "ranks": [{"rank": r, **self.coords(r)} for r in range(self.world_size)],
            "groups": {d: self.all_groups(d) for d in DIMS if self.sizes[d] > 1},
        }

    def format(self, nproc_per_node: int | None = None) -> str:
        """One line per rank with its coordinates (and node, given ``nproc_per_node``)."""
        per_node = nproc_per_node or self.world_size
        lines = [f"mesh {self.describe()} = {self.world_size} rank(s); tensor innermost"]
        lines.append(f"{'rank':>4}  {'node':>4}  " + "  ".join(f"{d:>8}" for d in DIMS))
        for r in range(self.world_size):
            c = self.coords(r)
            lines.append(f"{r:>4}  {r // per_node:>4}  " + "  ".join(f"{c[d]:>8}" for d in DIMS))
        for dim in DIMS:
            if self.sizes[dim] > 1:
                lines.append(f"{dim} groups: {self.all_groups(dim)}")
        tensor = self.sizes["tensor"]
        if tensor > 1 and per_node % tensor:
            lines.append(
                f"warning: tensor groups of {tensor} do not fit in nodes of {per_node} "
                "process(es): tensor parallelism would cross the network every layer"
            )
        return "\n".join(lines)


def layout(sizes: Mapping[str, int], world_size: int, rank: int) -> DeviceMesh:
    """The mesh ``sizes`` for rank ``rank`` of ``world_size``, without its groups; an error
    naming the sizes, the world size and the fix when they disagree. Pure: ``rw.init(mesh=...)``
    calls it before the rendezvous, so a wrong mesh fails every rank at once. No sync point.
    """
    if not isinstance(sizes, Mapping):
        raise ConfigError(
            f"mesh={sizes!r} is not a mapping of dimension names to sizes",
            fix='pass e.g. mesh={"data": 2, "tensor": 2} (names: ' + ", ".join(DIMS) + ").",
            rank=rank,
        )
    product = 1
    for value in sizes.values():
        product *= value if isinstance(value, int) and value > 0 else 1
    if product != world_size:  # checked first: the names are checked by DeviceMesh below
        DeviceMesh(sizes)  # unknown names and bad sizes get their own error
        raise ConfigError(
            f"mesh {dict(sizes)} has {product} rank(s) but the job has world size {world_size}",
            fix=f"choose sizes whose product is {world_size}, e.g. "
            f'{{"data": {max(world_size // 2, 1)}, "tensor": {min(world_size, 2)}}}, '
            f"or start {product} process(es) (rankwise run --nproc-per-node {product}).",
            rank=rank,
        )
    return DeviceMesh(sizes, rank=rank)


def create_groups(mesh: DeviceMesh) -> DeviceMesh:
    """Make ``mesh``'s process groups (returned, for chaining): one ``new_group`` per group
    of every dimension, on every rank in the same order (torch's rule for ``new_group``; a
    dimension of size 1 gets one-rank groups, so its collectives stay local). Nothing to make
    at world size 1.

    Sync point: all ranks.
    """
    if mesh.world_size == 1:
        return mesh
    from .process_group import new_group

    for dim in DIMS:
        for ranks in mesh.all_groups(dim):
            made = new_group(ranks)  # the job's timeout, not torch's 30 minutes
            if mesh.rank in ranks:
                mesh._groups[dim] = made
    return mesh


def check_same(current: DeviceMesh | None, sizes: Mapping[str, int] | None, rank: int) -> None:
    """A second ``rw.init`` may repeat the mesh (or leave it out), not ask for another one."""
    if sizes is None:
        return
    asked = DeviceMesh(sizes).sizes
    have = None if current is None else dict(current.sizes)
    if asked != have:
        raise RuntimeStateError(
            f"rw.init() was already called with mesh={have}; this call asks for mesh={asked}",
            fix="call rw.init(mesh=...) once at the start of the program, or rw.shutdown() "
            "first; rw.init_mesh(sizes) makes another mesh's groups beside the runtime's.",
            rank=rank,
        )


def init_mesh(sizes: Mapping[str, int]) -> DeviceMesh:
    """This rank's mesh with its process groups (``layout`` + ``create_groups``). Call it
    after ``rw.init()`` (or torch's ``init_process_group``); at world size 1 it makes no
    group. ``rw.init(mesh=sizes)`` does the same and keeps the mesh as ``rt.mesh``.

    Sync point: all ranks.
    """
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else 1
    rank = dist.get_rank() if initialized else 0
    return create_groups(layout(sizes, world, rank))
