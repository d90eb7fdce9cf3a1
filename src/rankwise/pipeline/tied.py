"""Weights shared by stages on different ranks (a GPT head tied to its embedding), kept equal.

Each rank that holds such a weight keeps its own copy. They start equal (the lowest stage's
copy is broadcast when the pipeline is built) and stay equal because every copy gets the same
gradient: the sum of the stages' parts (the embedding's on the first stage, the head's on the
last), one all-reduce per step on a group of just the ranks that hold it. The optimizer then
makes the same update on each.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm import collectives as comm
from ..job.process_group import new_group


def shared_across(
    owners: dict[int, set[int]], num_ranks: int
) -> list[tuple[tuple[int, ...], list[int]]]:
    """Group the parameters (``id -> pipeline positions holding it``) held by more than one
    position: ``[(positions, [param ids]), ...]`` in a canonical order (every rank computes
    the same list from the same model)."""
    sets: dict[tuple[int, ...], list[int]] = {}
    for pid, where in owners.items():
        if len(where) > 1:
            sets.setdefault(tuple(sorted(where)), []).append(pid)
    return sorted(sets.items())


class TiedWeights:
    """This rank's tied weights and the groups they are summed over.

    Sync point (construction): every rank of the job, once per pipeline group and tied set
    (``dist.new_group`` is collective), then the ranks of each tied group (the broadcast).
    """

    def __init__(
        self,
        pipeline_groups: Sequence[Sequence[int]],
        my_group: Sequence[int],
        sets: list[tuple[tuple[int, ...], list[nn.Parameter]]],
    ) -> None:
        self.entries: list[tuple[object, list[nn.Parameter], int]] = []
        for ranks in pipeline_groups:
            for positions, params in sets:
                members = [ranks[p] for p in positions]
                group = new_group(members) if dist.is_initialized() else None
                if list(ranks) == list(my_group) and comm.rank() in members:
                    self.entries.append((group, params, members[0]))
        with torch.no_grad():
            for group, params, src in self.entries:
                for p in params:  # the first stage's copy everywhere
                    comm.broadcast_(p.data, src, group=group, label="tied weights")

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, params, _ in self.entries for p in params]

    def owned_here(self, param: nn.Parameter) -> bool:
        """True unless a lower stage holds this tied weight too (norms count it once)."""
        return all(src == comm.rank() for _, params, src in self.entries
                   if any(p is param for p in params))  # fmt: skip

    def sum_grads(self, grads: dict[int, torch.Tensor]) -> None:
        """Each tied weight's gradient (in ``grads``: id -> tensor) replaced by the sum over
        the ranks that hold it. Sync point: the ranks of each tied group."""
        for group, params, _ in self.entries:
            for p in params:
                if id(p) not in grads:
                    grads[id(p)] = torch.zeros_like(p)
            summed = comm.all_reduce_(
                torch.cat([grads[id(p)].reshape(-1) for p in params]),
                "sum", group=group, label="tied weights' gradients",
            )  # fmt: skip
            pieces = summed.split([p.numel() for p in params])
            for p, g in zip(params, pieces, strict=True):
                grads[id(p)] = g.view_as(p)
