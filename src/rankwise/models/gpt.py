"""A small GPT in the nanoGPT style: token and position embeddings, a stack of pre-norm
transformer blocks in an ``nn.ModuleList``, a language-model head tied to the token embedding,
and ``generate()``.

It is here for the recipes (docs/recipes.md) and the character-level demo (examples/gpt.py):
a transformer with the shapes users bring to data parallelism (tied weights, one module per
block, parameters that take weight decay and parameters that do not), small enough to train
on a CPU.

    model = GPT(GPTConfig(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=128))
    logits, loss = model(idx, targets)           # loss: mean cross-entropy over every token
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=3e-4)
    text_ids = model.generate(prompt, max_new_tokens=200, temperature=0.8, top_k=20)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The sizes of a ``GPT``."""

    vocab_size: int
    """Number of distinct tokens (characters, for the demo)."""
    block_size: int = 64
    """Longest context the model attends over (the position embedding's length)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout after attention and MLP; 0 keeps runs deterministic (the recipes compare runs)."""
    bias: bool = True
    """Biases in the linear layers and layer norms."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"GPTConfig({name}={getattr(self, name)}) must be at least 1",
                    fix=f"pass a positive {name}.",
                )
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"GPTConfig(n_embd={self.n_embd}, n_head={self.n_head}): n_embd must be a "
                "multiple of n_head (each head gets n_embd // n_head channels)",
                fix=f"use n_head in {[h for h in range(1, 17) if self.n_embd % h == 0]}.",
            )


class NormalLinear(nn.Linear):
    """``nn.Linear`` initialised as GPT-2's: weight ~ N(0, ``std``), bias zero. Its
    ``reset_parameters()`` is that initialisation, so the model initialises itself in one
    pass, each layer as it is built: a GPT built under ``with torch.device("meta"):`` and
    initialised by ``rt.prepare`` (``exact_init=True``) equals one built eagerly at the same
    seed (docs/zero.md)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, std: float) -> None:
        self.std = std  # before nn.Linear's __init__, which calls reset_parameters()
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class NormalEmbedding(nn.Embedding):
    """``nn.Embedding`` initialised as GPT-2's: N(0, 0.02)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class CausalSelfAttention(nn.Module):
    """Multi-head attention where each position sees itself and the positions before it."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = NormalLinear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias, std=0.02)
        self.proj = NormalLinear(cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=_residual_std(cfg))
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (b, t, 3c) -> three (b, heads, t, c // heads)
        q, k, v = (
            z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for z in self.qkv(x).split(c, dim=2)
        )
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return F.dropout(self.proj(y), p, self.training)


def _residual_std(cfg: GPTConfig) -> float:
    """Residual projections are scaled down by depth so the residual stream's variance does
    not grow with the number of blocks (GPT-2's initialisation)."""
    return 0.02 / math.sqrt(2 * cfg.n_layer)


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``. One block is the
    natural unit to shard or checkpoint (a stage-3 gather unit, an FSDP ``fully_shard``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.Sequential(
            NormalLinear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias, std=0.02),
            nn.GELU(),
            NormalLinear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=_residual_std(cfg)),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets=None) -> (logits, loss or None)``.

    Every layer initialises itself as it is built (``NormalLinear``, ``NormalEmbedding``,
    torch's ``LayerNorm``), in registration order: a GPT built on the meta device is
    initialised by ``rt.prepare`` with the same values, bit for bit under ``exact_init=True``.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = NormalEmbedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = NormalEmbedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = NormalLinear(cfg.n_embd, cfg.vocab_size, bias=False, std=0.02)
        self.lm_head.weight = self.wte.weight  # tied: one matrix reads and writes tokens

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ConfigError(
                f"GPT got a sequence of {t} tokens; its block_size is {self.config.block_size}",
                fix="crop the input to the last block_size tokens, or build the model with a "
                "larger GPTConfig(block_size=...).",
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (shape ``(batch, t)``), each from
        the model's distribution over the last ``block_size`` tokens, sharpened by
        ``temperature`` and restricted to the ``top_k`` likeliest when given."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1, :].float() / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two optimizer groups, as nanoGPT and HF's Trainer build them: matrices and embeddings
    (2-D or more) take ``weight_decay``; biases and norm weights (1-D) take none. A tied
    parameter is listed once."""
    params = [p for p in model.parameters() if p.requires_grad]  # shared ones once
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
