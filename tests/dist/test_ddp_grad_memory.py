"""A DDP step holds one copy of the gradients: autograd's fresh gradient is freed once it is
copied into its bucket slot (torch's ``gradient_as_bucket_view`` semantics).

Before, the reducer kept every fresh gradient until the next step replaced it, beside the
buckets: a second copy of every gradient for the whole step. A hook registered before the
reducer's sees autograd's fresh gradient in ``.grad``; a weak reference to it must be dead once
backward has ended (before the change: all 4 alive), while ``.grad`` (the slot) is set. Buckets under and over the
shared-memory threshold (1 MiB), ``zero_grad`` with ``set_to_none`` before the forward.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

import rankwise as rw
from rankwise.testing import run_distributed

WIDTHS = (32, 600)  # one bucket of 16 KiB (Gloo), one of 1.4 MiB (shared memory)


def _fresh_alive(width: int) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
    refs: list[weakref.ref] = []
    for p in net.parameters():  # registered first: runs before the reducer's hook
        p.register_post_accumulate_grad_hook(lambda p: refs.append(weakref.ref(p.grad)))
    model = rw.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(rw.get_runtime().rank))
    alive = []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        refs.clear()
        model(x).square().mean().backward()
        gc.collect()
        alive.append(sum(r() is not None for r in refs))
        opt.step()
    in_slots = all(p.grad is not None for p in net.parameters())
    return {"alive": alive, "hooked": len(refs), "grads_set": in_slots}


def _all() -> dict:
    return {w: _fresh_alive(w) for w in WIDTHS}


def test_fresh_gradients_are_freed_once_copied_into_the_buckets():
    for by_width in run_distributed(_all, 2, timeout=180):
        for width, r in by_width.items():
            assert r["hooked"] == 4 and r["grads_set"], (width, r)
            assert r["alive"] == [0, 0, 0], (width, r)  # no fresh gradient outlives backward
