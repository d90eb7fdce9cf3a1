"""No replica can diverge: after every synchronised backward, ``.grad`` is identical on every
rank and equal to torch's DistributedDataParallel's, whatever mix of these happens:

- parameters used on some ranks and not others (``find_unused_parameters=True``),
- parameters used only in ``no_sync()`` micro-batches, on one rank, not in the final one,
- a layer frozen after wrapping, a module wrapped twice (the second wrapper is used),
- ``zero_grad(set_to_none=True/False)``, several steps in a row,
- gradients reduced in a flat bucket or, alone in their bucket, where autograd left them;
  through the process group's all-reduce or through shared memory.

Hypothesis draws the scenarios *inside* the ranks (spawned once per world size): every rank
runs the same derandomized generation, so all draw the same scenario, and each scenario is
checked by gathering every rank's gradients. Failures are collected, not raised, so ranks never
disagree on which collectives to run; the test asserts there were none.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import rankwise as rw
from rankwise.parallel import buckets as bucketing
from rankwise.parallel.ddp.node import shared_reduce
from rankwise.testing import run_distributed

DEFAULT_SOLO_BYTES = bucketing.SOLO_BYTES
DEFAULT_SHARED_MIN_BYTES = shared_reduce.MIN_BYTES

BLOCKS = 4
EXAMPLES = {2: 120, 3: 80}  # 200 scenarios over world sizes 2 and 3


class Blocks(nn.Module):
    """A trunk used by every pass and blocks that each pass may or may not use."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(3, 3)
        self.blocks = nn.ModuleList(nn.Linear(3, 3) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor, mask: tuple[bool, ...]) -> torch.Tensor:
        out = self.trunk(x)
        for on, block in zip(mask, self.blocks, strict=True):
            if on:
                out = out + block(x)
        return out


@st.composite
def scenarios(draw: st.DrawFn, world: int) -> dict:
    find_unused = draw(st.booleans()) if draw(st.integers(0, 4)) else False
    micro = draw(st.integers(1, 3))
    masks = st.tuples(*[st.booleans()] * BLOCKS)
    uses = [[draw(masks) for _ in range(world)] for _ in range(micro)]
    if not find_unused:  # torch and ours both refuse an unused parameter then: not a scenario
        uses[-1] = [(True,) * BLOCKS] * world
    return {
        "find_unused": find_unused,
        "uses": uses,
        "steps": draw(st.integers(1, 2)),
        "set_to_none": draw(st.booleans()),
        "freeze": draw(st.none() | st.integers(0, BLOCKS - 1)) if find_unused else None,
        "rewrap": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
        "solo": draw(st.booleans()),  # every gradient alone in its bucket, reduced in place
        "shared": draw(st.booleans()),  # every bucket reduced through shared memory
    }


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _build(case: dict) -> tuple[nn.Module, nn.Module]:
    bucketing.SOLO_BYTES = 1 if case["solo"] else DEFAULT_SOLO_BYTES
    shared_reduce.MIN_BYTES = 0 if case["shared"] else DEFAULT_SHARED_MIN_BYTES
    torch.manual_seed(case["seed"])
    base = Blocks()
    mine, theirs = base, copy.deepcopy(base)
    ours = rw.DistributedDataParallel(mine, find_unused_parameters=case["find_unused"])
    if case["rewrap"]:  # a second wrapper takes the parameters over from the first
        ours = rw.DistributedDataParallel(mine, find_unused_parameters=case["find_unused"])
    ref = nn.parallel.DistributedDataParallel(theirs, find_unused_parameters=case["find_unused"])
    return ours, ref


def _freeze(case: dict, ours: nn.Module, ref: nn.Module) -> None:
    for model in (ours, ref):
        model.module.blocks[case["freeze"]].requires_grad_(False)


def _compare(case: dict, rank: int, world: int) -> list[str]:
    ours, ref = _build(case)
    problems = []
    gen = torch.Generator().manual_seed(case["seed"] * 8 + rank)  # each rank its own data
    for step in range(case["steps"]):
        if case["freeze"] is not None and step == case["steps"] - 1:
            _freeze(case, ours, ref)  # after wrapping; with two steps, between them
        for m, masks in enumerate(case["uses"]):
            x = torch.randn(2, 3, generator=gen)
            last = m == len(case["uses"]) - 1
            for model in (ours, ref):
                with contextlib.nullcontext() if last else model.no_sync():
                    model(x, masks[rank]).pow(2).sum().backward()
        mine, theirs = _grads(ours.module), _grads(ref.module)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, [None if g is None else g.numpy() for g in mine])
        for r, other in enumerate(gathered):
            same = all(
                (a is None and b is None)
                or (a is not None and b is not None and (a.numpy() == b).all())
                for a, b in zip(mine, other, strict=True)
            )
            if not same:
                problems.append(f"step {step}: .grad differs between rank {rank} and rank {r}")
        # From 3 ranks on, the order in which Gloo sums the ranks' values depends on where an
        # element sits in its bucket, so a bucket layout other than torch's (a gradient alone in
        # its bucket) rounds differently: equal to float32 precision of the summands (~1-10).
        # Shared memory sums the ranks in rank order, which differs from Gloo's ring likewise.
        atol = 1e-6 if case["solo"] or case["shared"] else 1e-8
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            if (a is None) != (b is None) or (a is not None and not torch.allclose(a, b, atol=atol)):
                problems.append(f"step {step}: parameter {i} differs from torch's DDP: {a} {b}")
        with torch.no_grad():
            for model in (ours, ref):
                for p in model.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
                model.zero_grad(set_to_none=case["set_to_none"])
    return problems


def _property() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    failures: list = []
    count = [0]

    @settings(
        max_examples=EXAMPLES[world],
        derandomize=True,  # the same examples on every rank
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(scenarios(world))
    def check(case: dict) -> None:
        drawn: list = [None] * world
        dist.all_gather_object(drawn, repr(case))
        if len(set(drawn)) != 1:  # every rank sees this and stops together
            raise AssertionError(f"ranks drew different scenarios: {drawn}")
        count[0] += 1
        # Gathered so that every rank records the same verdict (and runs the same collectives).
        found: list = [None] * world
        dist.all_gather_object(found, _compare(case, rank, world))
        if any(found):
            failures.append((case, found))

    check()
    return {"examples": count[0], "failures": failures[:3], "failed": len(failures)}


@pytest.mark.parametrize("world", [2, 3])
def test_no_replica_diverges_and_grads_equal_torchs(world):
    results = run_distributed(_property, world, timeout=400)
    for res in results:
        assert res["examples"] == EXAMPLES[world]
        assert res["failed"] == 0, res["failures"]
