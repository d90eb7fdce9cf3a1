"""Models and loops for the meta-device tests (imported by the spawned ranks too).

``exact_vs_eager`` builds each model twice at the same seed, eagerly and under
``torch.device("meta")``, prepares both with the same strategy and trains both on the same
batches: the meta-built one (``exact_init=True``) must equal the eager one bit for bit.
``default_mode`` prepares a meta model with per-rank seeds and checks what default
initialisation promises: rank 0's random state, every tensor set, plausible distributions,
buffers recomputed, this rank's own generator left as it was.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

import rankwise as rw
from rankwise.checkpoint.state_dict import model_state
from rankwise.models import GPT, GPTConfig, param_groups

SEED, STEPS = 1234, 3
GPT_CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


class Plain(nn.Module):
    """Only torch's own layers: two repeated blocks (stage-3 units), norms, a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.out(self.bn(h))


class Causal(nn.Module):
    """Buffers computed in ``__init__`` (a causal mask, a rotary table), not saved, and
    computed again by ``reset_parameters()`` as FSDP's convention asks."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.proj = nn.Linear(n, n)
        self.register_buffer("mask", torch.ones(n, n).tril().bool(), persistent=False)
        self.register_buffer("freqs", self._freqs(), persistent=False)

    def _freqs(self) -> torch.Tensor:
        return 1.0 / (10000 ** (torch.arange(0, self.n, 2).float() / self.n))

    def reset_parameters(self) -> None:
        self.mask.copy_(torch.ones(self.n, self.n).tril().bool())
        self.freqs.copy_(self._freqs())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = (x @ x.transpose(-1, -2)).masked_fill(~self.mask, float("-inf"))
        return self.proj(scores.softmax(-1) @ x)


class Checked(nn.Module):
    """Large enough to judge the distributions: kaiming-uniform weights, N(0, 1) rows."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(200, 16)
        self.causal = Causal(16)
        self.wide = nn.Linear(16, 256)
        self.bn = nn.BatchNorm1d(256)
        self.head = nn.Linear(256, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.causal(self.emb(idx)).mean(1)
        return self.head(torch.relu(self.bn(self.wide(h))))


def build(kind: str) -> nn.Module:
    return {"gpt": lambda: GPT(GPT_CFG), "plain": Plain, "checked": Checked}[kind]()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, weight_decay=0.1)
    return torch.optim.AdamW(groups, lr=1e-2)


def batch(kind: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    if kind == "gpt":
        idx = torch.randint(0, 32, (4, 8), generator=g)
        return idx, idx.roll(-1, 1)
    if kind == "checked":
        return torch.randint(0, 200, (4, 16), generator=g), torch.randint(0, 4, (4,), generator=g)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def loss(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "gpt":
        return model(x, y)[1].mean()  # DataParallel gathers one loss per device
    if kind == "checked":
        return F.cross_entropy(model(x), y)
    return F.mse_loss(model(x), y)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state (gathered by the sharded engine; every strategy's keys bare)."""
    collective = getattr(model, "collective_state_dict", False)
    state = model.state_dict() if collective else model_state(model)
    return {k: v.detach().clone() for k, v in state.items()}


def differing(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return [k for k in a if not torch.equal(a[k], b[k])]


def train(kind: str, model: nn.Module, opt, rank: int) -> list[float]:
    out = []
    for step in range(STEPS):
        value = loss(kind, model, *batch(kind, step, rank))
        value.backward()
        opt.step()
        opt.zero_grad()
        out.append(value.item())
    return out


def _pair(rt, kind: str) -> dict:
    """Eager and meta builds at the same seed, prepared, trained: what differs."""
    torch.manual_seed(SEED)
    eager = build(kind)
    rng_after_build = torch.get_rng_state()
    e_model, e_opt = rt.prepare(eager, adamw(eager))
    torch.manual_seed(SEED)
    with torch.device("meta"):
        meta = build(kind)
    m_model, m_opt = rt.prepare(meta, adamw(meta), exact_init=True)
    same_rng = torch.equal(torch.get_rng_state(), rng_after_build)
    prepared = full_state(m_model)
    before = differing(full_state(e_model), prepared)
    e_losses = train(kind, e_model, e_opt, rt.rank)
    m_losses = train(kind, m_model, m_opt, rt.rank)
    after = full_state(m_model)
    moved = [k for k in after if k in dict(meta.named_parameters()) and
             not torch.equal(after[k], prepared[k])]  # fmt: skip
    return {
        "same_rng": same_rng,
        "before": before,
        "after": differing(full_state(e_model), after),
        "losses": (e_losses, m_losses),
        "moved": len(moved),
        "params": len(dict(meta.named_parameters())),
    }


def default_mode(rt) -> dict:
    """Per-rank seeds; default initialisation; what it promises."""
    torch.manual_seed(1000 + rt.rank)
    with torch.device("meta"):
        meta = Checked()
    rng_before = torch.get_rng_state()
    model, opt = rt.prepare(meta, adamw(meta))
    rng_kept = torch.equal(torch.get_rng_state(), rng_before)
    state = full_state(model)
    torch.manual_seed(1000)  # rank 0's seed: the state every rank drew from
    want = Checked().state_dict()
    nan = [k for k, v in state.items() if v.is_floating_point() and bool(v.isnan().any())]
    w, bound = state["wide.weight"], 1 / math.sqrt(16)
    facts = {
        "rng_kept": rng_kept,
        "rank0": differing(want, {k: v for k, v in state.items() if k in want}),
        "nan": nan,
        "kaiming": (float(w.abs().max()) <= bound, float(w.std()) / (bound / math.sqrt(3))),
        "normal": float(state["emb.weight"].std()),
        "bn": (
            state["bn.running_mean"].abs().max().item(),
            state["bn.running_var"].min().item(),
            state["bn.running_var"].max().item(),
            int(state["bn.num_batches_tracked"]),
        ),
        "mask": torch.equal(_bare(model).causal.mask, torch.ones(16, 16).tril().bool()),
        "freqs": torch.equal(_bare(model).causal.freqs, Causal(16)._freqs()),
        "losses": train("checked", model, opt, rt.rank),
    }
    return facts


def _bare(model: nn.Module) -> nn.Module:
    return model._modules.get("module", model)


def unequal_seeds_refused(rt) -> str:
    torch.manual_seed(7 + rt.rank)
    with torch.device("meta"):
        meta = Plain()
    try:
        rt.prepare(meta, adamw(meta), exact_init=True)
    except rw.ConfigError as exc:
        return str(exc)
    return ""


def every_check(strategy: str) -> dict:
    rt = rw.init(strategy=strategy)
    torch.set_num_threads(1)
    return {
        "gpt": _pair(rt, "gpt"),
        "plain": _pair(rt, "plain"),
        "default": default_mode(rt),
        "refused": unequal_seeds_refused(rt),
    }


def mesh_pair(strategy: str) -> dict:
    """data 2 x tensor 2: the tiny GPT split by ``rw.tensor_parallel`` eagerly and on the meta
    device (pieces cut at prepare), both prepared and trained on the same batches."""
    from rankwise.parallel.tensor.tiny_gpt import GPT as TinyGPT
    from rankwise.parallel.tensor.tiny_gpt import GPT_PLAN
    from rankwise.parallel.tensor.tiny_gpt import GPTConfig as TinyConfig

    rt = rw.init(strategy=strategy, mesh={"data": 2, "tensor": 2})
    torch.set_num_threads(1)
    cfg, tensor = TinyConfig(qkv_bias=False), rt.mesh.group("tensor")
    models = []
    for meta in (False, True):
        torch.manual_seed(SEED)
        with torch.device("meta") if meta else contextlib.nullcontext():
            split = rw.tensor_parallel(TinyGPT(cfg), GPT_PLAN, group=tensor)
        opt = torch.optim.AdamW(split.parameters(), lr=1e-2)
        models.append(rt.prepare(split, opt, exact_init=meta))
    states = [[full_state(m)] for m, _ in models]
    g = torch.Generator().manual_seed(rt.mesh.coord("data"))
    for _ in range(STEPS):
        x, y = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)
        for (model, opt), seen in zip(models, states, strict=True):
            rw.vocab_parallel_cross_entropy(model(x), y, tensor).backward()
            opt.step()
            opt.zero_grad()
            seen.append(full_state(model))
    (eager, meta) = states
    return {"differ": [differing(a, b) for a, b in zip(eager, meta, strict=True)],
            "moved": differing(meta[0], meta[-1])}  # fmt: skip
