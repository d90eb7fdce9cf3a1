"""Models, data and training loops shared by the DDP tests (imported by spawned ranks too).

Every case trains for STEPS steps. Each rank starts from a *different* random initialisation
(seed 1000 + rank) so the tests also check that construction broadcasts rank 0's weights; the
single-process oracle starts from rank 0's (seed 1000) and trains on the concatenation of all
ranks' batches, which is what data parallelism must be equivalent to.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

STEPS = 20
BATCH = 4


class Branchy(nn.Module):
    """A trunk, a branch used only on some ranks/steps, and a head that is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.branch = nn.Linear(8, 4)
        self.never = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        out = self.trunk(x)
        return out + self.branch(x) if use_branch else out


class Tied(nn.Module):
    """Embedding and output projection share one weight (as in language models)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(self.emb(idx).mean(1))))


class Span(nn.Module):
    """Model parallel inside one process: the first layer on the CPU, the rest on cuda:0."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.rest = nn.Sequential(nn.ReLU(), nn.Linear(16, 4)).to("cuda:0")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(self.first(x).to("cuda:0")).to(x.device)


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def cnn(bn: bool = False) -> nn.Module:
    norm = [nn.BatchNorm2d(4)] if bn else []
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        *norm,
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def frozen() -> nn.Module:
    model = mlp()
    model[0].requires_grad_(False)
    return model


@dataclass(frozen=True)
class Case:
    build: str
    optimizer: str = "sgd"
    micro: int = 1
    mode: str = "plain"  # plain | no_sync | no_sync_forward | no_sync_backward | flag
    find_unused: bool = False
    torch_too: bool = True
    input: str = "vec"  # vec | img | idx


CASES = {
    "mlp_sgd": Case("mlp"),
    "mlp_adam": Case("mlp", optimizer="adam"),
    "cnn_adam": Case("cnn", optimizer="adam", input="img"),
    "cnn_bn": Case("cnn_bn", input="img"),  # torch DDP only: BN batch stats are per rank
    "branchy": Case("branchy", optimizer="adam", find_unused=True),
    "frozen": Case("frozen", optimizer="adam"),
    "tied": Case("tied", optimizer="adam", input="idx"),
    "accum_no_sync": Case("mlp", micro=4, mode="no_sync"),
    "accum_no_sync_forward": Case("mlp", micro=4, mode="no_sync_forward"),
    "accum_no_sync_backward": Case("mlp", optimizer="adam", micro=4, mode="no_sync_backward"),
    "accum_flag": Case("mlp", micro=4, mode="flag", torch_too=False),
    # Needs CUDA: not in the CPU runs. Torch's DDP refuses a module on two device types
    # ("must be on the same type of devices"): ours is held to one process alone.
    "span": Case("span", optimizer="adam", torch_too=False),
}


def build(name: str) -> nn.Module:
    return {
        "mlp": mlp,
        "cnn": cnn,
        "cnn_bn": lambda: cnn(bn=True),
        "branchy": Branchy,
        "frozen": frozen,
        "tied": Tied,
        "span": Span,
    }[name]()


def data(case: Case, world: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels indexed [step, rank, micro, sample, ...], the same in every process."""
    g = torch.Generator().manual_seed(seed)
    lead = (STEPS, world, case.micro, BATCH)
    if case.input == "img":
        x = torch.randn(*lead, 1, 8, 8, generator=g)
    elif case.input == "idx":
        x = torch.randint(0, 10, (*lead, 3), generator=g)
    else:
        x = torch.randn(*lead, 8, generator=g)
    classes = 10 if case.input == "idx" else 4
    return x, torch.randint(0, classes, lead, generator=g)


def use_branch(step: int, rank: int) -> bool:
    return (step + rank) % 2 == 0


def optimizer(case: Case, params) -> torch.optim.Optimizer:
    if case.optimizer == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def forward(case: Case, model: nn.Module, x: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    if case.build == "branchy":
        return model(x, use_branch=use_branch(step, rank))
    return model(x)


def train_replica(case: Case, model: nn.Module, world: int, rank: int) -> None:
    """Train a DDP-wrapped ``model`` (ours or torch's) on this rank's share of the data."""
    x, y = data(case, world)
    opt = optimizer(case, model.parameters())
    device = next(model.parameters()).device
    for step in range(STEPS):
        for m in range(case.micro):
            last = m == case.micro - 1
            xb, yb = x[step, rank, m].to(device), y[step, rank, m].to(device)

            def skip(where: str, last=last):
                uses = {"no_sync": "both", "no_sync_forward": "forward"}
                uses["no_sync_backward"] = "backward"
                if last or uses.get(case.mode) != where:
                    return contextlib.nullcontext()
                return model.no_sync()

            if case.mode == "flag":  # nanoGPT's way
                model.require_backward_grad_sync = last
            if case.mode == "no_sync":  # torch's documented pattern: both inside
                with skip("both"):
                    loss = F.cross_entropy(forward(case, model, xb, step, rank), yb)
                    (loss / case.micro).backward()
                continue
            with skip("forward"):
                loss = F.cross_entropy(forward(case, model, xb, step, rank), yb) / case.micro
            with skip("backward"):
                loss.backward()
        opt.step()
        opt.zero_grad()


def train_oracle(case: Case, world: int, device: str = "cpu") -> nn.Module:
    """One process, rank 0's initial weights, every rank's batches at once."""
    torch.manual_seed(1000)
    model = build(case.build)
    if not isinstance(model, Span):
        model = model.to(device)
    first = next(model.parameters()).device  # Span's first layer stays on the CPU
    x, y = (t.to(first) for t in data(case, world))
    opt = optimizer(case, [p for p in model.parameters() if p.requires_grad])
    for step in range(STEPS):
        if case.build == "branchy":  # each rank's share has its own branch decision
            losses = [
                F.cross_entropy(forward(case, model, x[step, r, 0], step, r), y[step, r, 0])
                for r in range(world)
            ]
            loss = torch.stack(losses).mean()
        else:
            feats = x[step].reshape(-1, *x.shape[4:])
            loss = F.cross_entropy(model(feats), y[step].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.cpu() if not isinstance(model, Span) else model


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


LOOP_ORDERS = [
    ("first", True), ("after_forward", True), ("last", True), ("first", False), ("last", False),
]  # fmt: skip
"""Where ``zero_grad(set_to_none=...)`` goes in a step: before the forward, after it (the
PyTorch tutorials' order), or after ``opt.step()``."""


def backward_in_order(model, opt, x, y, order: str, to_none: bool) -> None:
    """A step up to ``backward()``, with ``zero_grad`` before or after the forward as ``order``
    says (for ``last`` the caller zeroes after ``opt.step()``)."""
    if order == "first":
        opt.zero_grad(set_to_none=to_none)
    out = model(x)
    if order == "after_forward":
        opt.zero_grad(set_to_none=to_none)
    F.cross_entropy(out, y).backward()
