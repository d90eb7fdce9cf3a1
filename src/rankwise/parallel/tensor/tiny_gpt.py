"""A small GPT written to be split by ``tensor_parallel`` (tests, benchmark, docs).

The one thing a tensor-parallel attention must do differently: never store the head count or
the width it computes with. It reads them from the projection's output, so the same code runs
whole (all heads) and split (``n_head / size`` heads per rank): ``q.view(B, T, -1, head_dim)``
and ``y.reshape(B, T, -1)``. The MLP needs nothing; the head is tied to the embedding.

``sequential_gpt`` is the same GPT as an ``nn.Sequential`` (embeddings, blocks, head), the
form ``rw.DistributedPipeline`` splits into stages; its head is untied (docs/model-parallel.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .plan import Column

__all__ = ["GPT", "GPT_PLAN", "SEQUENTIAL_PLAN", "GPTConfig", "sequential_gpt"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 64
    """Tokens; a multiple of the tensor size."""
    block_size: int = 16
    """Longest sequence (positions)."""
    n_layer: int = 2
    n_head: int = 4
    """Heads; a multiple of the tensor size."""
    n_embd: int = 32
    qkv_bias: bool = True
    """False for training oracles: the key bias's gradient is exactly zero in exact arithmetic
    (softmax ignores a constant per query), so Adam turns its round-off into lr-sized steps
    that differ between any two summation orders."""


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.qkv_bias)  # [q; k; v]
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (
            t.view(B, T, -1, self.head_dim).transpose(1, 2)  # -1: the heads this rank has
            for t in self.qkv(x).chunk(3, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.n_embd), SelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab]`` (this rank's vocabulary slice once
    split: use ``vocab_parallel_cross_entropy``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


GPT_PLAN = {
    "wte": "vocab",
    "blocks.*.attn.qkv": Column(chunks=3),
    "blocks.*.attn.proj": "row",
    "blocks.*.mlp.fc": "column",
    "blocks.*.mlp.proj": "row",
    "lm_head": "column",
}
"""How ``GPT`` splits: Megatron's pairs (qkv/proj, fc/proj), the vocabulary on both ends."""


class Embeddings(nn.Module):
    """Token ids -> the first residual stream: a pipeline's first layer."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    """The last residual stream -> logits (this rank's vocabulary slice once split)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def sequential_gpt(cfg: GPTConfig) -> nn.Sequential:
    """``GPT(cfg)`` as ``nn.Sequential(Embeddings, *blocks, Head)`` for pipelines, with an
    untied head: a weight shared by the first and the last stage would live in two processes."""
    return nn.Sequential(Embeddings(cfg), *(Block(cfg) for _ in range(cfg.n_layer)), Head(cfg))


SEQUENTIAL_PLAN = {
    "*.wte": "vocab",
    "*.attn.qkv": Column(chunks=3),
    "*.attn.proj": "row",
    "*.mlp.fc": "column",
    "*.mlp.proj": "row",
    "*.lm_head": "column",
}
"""``GPT_PLAN`` for ``sequential_gpt`` (its layers are named '0', '1', ...)."""
