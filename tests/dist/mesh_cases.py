"""What the mesh tests share: the tiny GPT's config, its batches and its optimizer.

The data (seed 7) is one on which fp32 itself is good to 1e-5: AdamW turns the round-off of a
gradient near its eps into a visible step, and on some draws one fp32 process differs from fp64
by 2e-5 (seed 11) while on this one by 5e-6.
"""

from __future__ import annotations

import torch

from rankwise.models import GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=32, qkv_bias=False)
GLOBAL_BATCH, TOL = 4, 1e-5
MAX_NORM = 0.05  # below the first batch's gradient norm: the step is clipped


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of (tokens, targets), the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randint(0, 64, (GLOBAL_BATCH, 8), generator=g),
         torch.randint(0, 64, (GLOBAL_BATCH, 8), generator=g))
        for _ in range(steps)
    ]  # fmt: skip


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
