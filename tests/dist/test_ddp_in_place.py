"""A gradient alone in its bucket is all-reduced where autograd left it, in every loop order.

Copying a large gradient into a flat bucket and reading it back costs more than sending it on its
own, so a gradient of at least ``buckets.SOLO_BYTES`` travels alone and is averaged in place
(docs/ddp.md, Performance), with no flat buffer allocated for it. This is the path of GPU
buckets and of ranks on several machines; ranks on one machine over Gloo use shared memory
instead (tests/dist/test_ddp_shared_memory.py), so it is switched off here. The parameters must equal torch's DistributedDataParallel's
bit for bit at world size 2 (scaling by 1/2 is exact and a sum of two is order-free), whichever
of the usual places ``zero_grad`` takes in the step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from ddp_cases import LOOP_ORDERS, backward_in_order
from torch import nn

import rankwise as rw
from rankwise.parallel import buckets
from rankwise.testing import run_distributed


def _net() -> nn.Module:
    assert buckets.SOLO_BYTES <= 1024 * 1024 * 4  # the first weight must travel alone
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 4))


def _order(order: str, to_none: bool) -> dict:
    torch.manual_seed(0)
    ours = rw.DistributedDataParallel(_net(), shared_memory_reduce=False)
    torch.manual_seed(0)
    theirs = nn.parallel.DistributedDataParallel(_net())
    big = ours.module[0].weight
    alone = [[ours.reducer.params[i] for i in b.indices] == [big] for b in ours.reducer.buckets]
    made: list[int] = []  # where autograd put each new gradient of the big weight
    big.register_hook(lambda g: made.append(g.data_ptr()))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    kept = []
    for _ in range(3):
        x, y = torch.randn(8, 1024, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        for model, opt in zip((ours, theirs), opts, strict=True):
            backward_in_order(model, opt, x, y, order, to_none)
            if model is ours:
                kept.append(big.grad is not None and big.grad.data_ptr() == made[-1])
            opt.step()
            if order == "last":
                opt.zero_grad(set_to_none=to_none)
    same = all(
        torch.equal(a, b)
        for a, b in zip(ours.module.parameters(), theirs.module.parameters(), strict=True)
    )
    # Its bucket never needed a flat buffer: the 4 MiB a copy would have taken are not allocated.
    b = alone.index(True)
    return {"alone": any(alone), "equal": same, "kept": kept, "buffer": ours.reducer._flat[b]}


def _all_orders() -> dict:
    return {f"{o}/{'none' if n else 'zero'}": _order(o, n) for o, n in LOOP_ORDERS}


def test_large_gradients_are_averaged_in_place_and_equal_torchs():
    for rank, res in enumerate(run_distributed(_all_orders, 2, timeout=180)):
        for order, r in res.items():
            assert r["alone"], f"{order}: the 4 MiB weight does not have a bucket of its own"
            assert r["equal"], f"rank {rank}, {order}: parameters differ from torch's DDP"
            if order.endswith("/none"):  # .grad was None: autograd's tensor is the result
                assert all(r["kept"]), f"rank {rank}, {order}: the gradient was copied {r}"
            assert r["buffer"] is None, f"rank {rank}, {order}: an unused flat buffer was made"
