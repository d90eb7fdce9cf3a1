"""Every registered strategy runs the README loop and trains what one process trains by hand.

The loop below is the README's: ``rw.init(strategy=name)``, ``rt.prepare(model, opt,
DataLoader(...))``, epochs of steps, ``rt.save`` on every rank. For each entry of
``rankwise.strategies.STRATEGIES`` it runs in the layout the entry declares — one process
('one'), two CPU replicas in one process ('threads'), two Gloo ranks ('processes') — with the
DataLoader's ``batch_size`` chosen from the entry's ``batch_meaning`` so that every run takes
the same global batch per step. The oracle is plain torch in one process: the same model,
Adam, and the global batches of torch's DistributedSampler order (a permutation seeded with
seed 0 + epoch, cut into consecutive global batches). The saved checkpoint must hold the
oracle's parameters (fp32, 1e-5). 'auto' at world 2 is run too, with a device capacity that
only ZeRO stage 2 fits on rank 1: both ranks must settle on it and still match the oracle.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw
from rankwise import strategies
from rankwise.testing import run_distributed

WORLD = 2
GLOBAL_BATCH = 8
STEPS_PER_EPOCH = 3
EPOCHS = 2
TOL = 1e-5


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(GLOBAL_BATCH * STEPS_PER_EPOCH, 6, generator=g)
    return TensorDataset(x, torch.randint(0, 3, (len(x),), generator=g))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch_size(spec: strategies.Strategy) -> int:
    """The DataLoader batch_size that means GLOBAL_BATCH per step under ``spec``."""
    return GLOBAL_BATCH // WORLD if spec.batch_meaning == "per_process" else GLOBAL_BATCH


def readme_loop(name: str, devices: list[str] | None, ckpt: str) -> tuple[str, int]:
    """The README's loop under ``strategy=name``; returns (rt.strategy, global batch)."""
    rt = rw.init(strategy=name, devices=devices)
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    spec = strategies.get(rt.strategy) if name == strategies.AUTO else strategies.get(name)
    loader = DataLoader(_data(), batch_size=_batch_size(spec), shuffle=True)
    model, opt, loader = rt.prepare(model, opt, loader)
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        rt.save(ckpt, model=model, optimizer=opt, loader=loader, epoch=epoch)
    return rt.strategy, loader.global_batch_size


def _ranks(runs: list[tuple[str, str]]) -> list[tuple[str, int]]:
    """Each (strategy, checkpoint dir) in turn, in one process group (rw.init adopts it)."""
    from rankwise.session import auto

    dist.init_process_group("gloo")
    out = []
    for name, ckpt in runs:
        if name == strategies.AUTO:  # rank 1 is the smallest device: only zero2 fits there
            auto.capacity_bytes = _capacity_only_zero2_fits
        out.append(readme_loop(name, None, ckpt))
        rw.shutdown()  # the group is the test's: rw leaves it alone
    dist.destroy_process_group()
    return out


def _capacity_only_zero2_fits(device: torch.device, local_world_size: int) -> int:
    from rankwise.parallel.zero.memory_plan import bytes_per_rank

    count = sum(p.numel() for p in _net().parameters())
    need = {s: bytes_per_rank(count, WORLD, s) for s in ("zero1", "zero2")}
    return 2**40 if dist.get_rank() == 0 else (need["zero1"] + need["zero2"]) // 2


def _oracle() -> dict[str, torch.Tensor]:
    """One process, plain torch, the global batches in DistributedSampler order."""
    model, data = _net(), _data()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for epoch in range(EPOCHS):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
        for step in range(STEPS_PER_EPOCH):
            x, y = data[order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]]
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return model.state_dict()


def _saved(ckpt: str) -> dict[str, torch.Tensor]:
    model = _net()
    rw.load_checkpoint(ckpt, model=model)  # the latest: saved after the last epoch
    return model.state_dict()


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_every_strategy_runs_the_readme_loop_and_matches_one_process(tmp_path: Path):
    oracle = _oracle()
    assert _max_diff(oracle, _net().state_dict()) > 1e-2  # training moved the parameters
    runs: dict[str, tuple[str, int]] = {}
    by_kind = {k: [s.name for s in strategies.STRATEGIES.values() if s.kind == k]
               for k in ("one", "threads", "processes")}  # fmt: skip
    assert sum(map(len, by_kind.values())) == len(strategies.STRATEGIES)
    for name in by_kind["one"]:
        runs[name] = readme_loop(name, None, str(tmp_path / name))
        rw.shutdown()
    for name in by_kind["threads"]:
        runs[name] = readme_loop(name, ["cpu"] * WORLD, str(tmp_path / name))
        rw.shutdown()
    launched = [*by_kind["processes"], strategies.AUTO]
    dirs = [(name, str(tmp_path / name)) for name in launched]
    ranks = run_distributed(_ranks, WORLD, args=(dirs,), init=False, timeout=240)
    assert ranks[0] == ranks[1]  # both ranks settled 'auto' alike
    runs.update(zip(launched, ranks[0], strict=True))
    assert runs[strategies.AUTO][0] == "zero2", runs[strategies.AUTO]
    for name, (settled, global_batch) in runs.items():
        assert global_batch == GLOBAL_BATCH, (name, global_batch)
        assert name == strategies.AUTO or settled == name
        diff = _max_diff(oracle, _saved(str(tmp_path / name)))
        assert diff <= TOL, f"strategy={name!r}: max |delta| {diff:.2e} from one process"


@pytest.mark.parametrize("name", ["zero1"])
def test_a_plain_dataloader_under_zero_keeps_ddp_meaning(name: str):
    """``rt.prepare`` under 'zero1' once raised KeyError: 'zero1' on a plain DataLoader."""
    rt = rw.init(strategy=name)
    model = _net()
    _, _, loader = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              DataLoader(_data(), batch_size=4))  # fmt: skip
    assert (loader.batch_size, loader.global_batch_size) == (4, 4)  # per process, world 1
