"""Models, data and loops for the sharded-engine tests (imported by the spawned ranks too).

Every rank builds its model from a different seed (1000 + rank), so the tests also check that
the engine starts from rank 0's weights. The oracles start from seed 1000: one process trained
on the concatenation of every rank's batch, and our DDP on the same per-rank batches.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import rankwise as rw

STEPS = 20
GLOBAL_BATCH = 12
"""Fixed whatever the world size (12 = 1, 2, 3, 4 ranks x 12/N): runs at different world sizes
are then the same computation, so a checkpoint may move between them mid-run."""


class Net(nn.Module):
    """Nested modules (stage 3 units inside units), a root-level parameter, and an odd size
    (35 + 40 + ... elements: shards straddle parameters and need padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.block = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 7))
        self.out = nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(h + self.block(h)) * self.scale


class Tied(nn.Module):
    """An embedding shared with the output layer, a frozen layer, and a sometimes-unused one."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.mid = nn.Linear(6, 6)
        self.side = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        h = self.frozen(self.emb(idx).mean(1))
        h = torch.relu(self.mid(h))
        if use_side:
            h = h + self.side(h)
        return self.out(h)


def build(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return {"net": Net, "tied": Tied, "tied_all": Tied}[kind]()


def use_side(kind: str, rank: int, step: int) -> dict:
    """'tied': rank 1 skips the side layer at odd steps (a rank-dependent unused parameter);
    'tied_all': every rank skips it at odd steps (stage 3 needs the same modules called on
    every rank, as torch's FSDP does)."""
    if kind == "tied":
        return {"use_side": not (rank == 1 and step % 2)}
    if kind == "tied_all":
        return {"use_side": not step % 2}
    return {}


def batch(kind: str, step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    n = GLOBAL_BATCH
    if kind != "net":
        return torch.randint(0, 11, (n, 4), generator=g), torch.randint(0, 11, (n,), generator=g)
    return torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)


def loss_of(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, **kw) -> torch.Tensor:
    out = model(x, **kw)
    return F.mse_loss(out, y) if kind == "net" else F.cross_entropy(out, y)


def make_opt(name: str):
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01)
    return lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)


def _mine(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    b = GLOBAL_BATCH // world
    return x[rank * b : (rank + 1) * b]


def train(
    engine: str, kind: str, opt: str, steps: int = STEPS, *, accum: int = 1, clip: float = 0.0,
    start: int = 0, load: str | None = None, save: str | None = None, device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """Train ``steps`` steps from ``start``; returns the full state. engine: 'one' (one process
    on the concatenated batch), 'ddp', 'zero1|2|3'. ``accum`` micro-batches per step (no_sync
    on all but the last). ``load``/``save``: a checkpoint read before / written after."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    base = build(kind, 1000 + (0 if engine == "one" else rank)).to(device)
    if engine == "one":
        wrapped, optimizer = base, make_opt(opt)(list(base.parameters()))
    elif engine == "ddp":
        wrapped = rw.DistributedDataParallel(base, find_unused_parameters=kind != "net")
        optimizer = make_opt(opt)(list(base.parameters()))
    else:
        wrapped = rw.ShardedDataParallel(base, make_opt(opt), stage=int(engine[-1]),
                                         unit_numel=1)
        optimizer = wrapped.optimizer
    if load is not None:
        rw.load_checkpoint(load, model=wrapped, optimizer=optimizer)
    for step in range(start, start + steps):
        for micro in range(accum):
            x, y = (t.to(device) for t in batch(kind, step * accum + micro, world))
            kw = use_side(kind, rank, step)
            if engine == "one":
                # The concatenated batch, with each rank's share weighted as the mean of means.
                losses = []
                for r in range(world):
                    kw_r = use_side(kind, r, step)
                    losses.append(
                        loss_of(kind, wrapped, _mine(x, r, world), _mine(y, r, world), **kw_r)
                    )
                (torch.stack(losses).mean() / accum).backward()
                continue
            last = micro == accum - 1
            ctx = contextlib.nullcontext() if last else wrapped.no_sync()
            with ctx:
                loss = loss_of(kind, wrapped, _mine(x, rank, world), _mine(y, rank, world), **kw)
                (loss / accum).backward()
        if kind == "tied_all" and engine in ("one", "ddp"):
            # The sharded engine's rule for a parameter no rank used: a zero gradient (the
            # optimizer still applies momentum and weight decay), as torch's FSDP does.
            for p in base.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        if clip:
            if engine == "one" or engine == "ddp":
                torch.nn.utils.clip_grad_norm_(base.parameters(), clip)
            else:
                wrapped.clip_grad_norm_(clip)
        optimizer.step()
        optimizer.zero_grad()
    if save is not None:
        rw.save_checkpoint(save, model=wrapped, optimizer=optimizer)
    state = wrapped.state_dict()
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def torch_peers(opt: str) -> dict[str, float]:
    """torch's ZeroRedundancyOptimizer (over torch's DDP) vs our stage 1, and FSDP2's
    ``fully_shard`` (one unit per layer and the root) vs our stage 3, on the same inputs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    zro_model = torch.nn.parallel.DistributedDataParallel(build("net", 1000 + rank))
    kwargs = {"momentum": 0.9} if opt == "sgd" else {}
    cls = torch.optim.SGD if opt == "sgd" else torch.optim.AdamW
    probe = make_opt(opt)([torch.nn.Parameter(torch.zeros(1))])
    hyper = {k: probe.defaults[k] for k in ("lr", "weight_decay", *kwargs)}
    zro = ZeroRedundancyOptimizer(zro_model.parameters(), optimizer_class=cls, **hyper)
    fsdp_model = build("net", 1000)
    mesh = init_device_mesh("cpu", (world,))
    for sub in (fsdp_model.inp, fsdp_model.block, fsdp_model.out):
        fully_shard(sub, mesh=mesh)
    fully_shard(fsdp_model, mesh=mesh)
    fsdp_opt = make_opt(opt)(list(fsdp_model.parameters()))
    for step in range(STEPS):
        x, y = batch("net", step, world)
        for model, optimizer in ((zro_model, zro), (fsdp_model, fsdp_opt)):
            loss_of("net", model, _mine(x, rank, world), _mine(y, rank, world)).backward()
            optimizer.step()
            optimizer.zero_grad()
    full = {k: v.full_tensor() for k, v in fsdp_model.state_dict().items()}
    out["torch_zero_redundancy_vs_zero1"] = max_diff(
        {k: v.detach() for k, v in zro_model.module.state_dict().items()}, train("zero1", "net", opt)
    )
    out["torch_fsdp2_vs_zero3"] = max_diff(full, train("zero3", "net", opt))
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)
