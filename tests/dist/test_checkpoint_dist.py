"""Checkpoints across processes: every rank calls, rank 0 writes, a failure reaches every rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise.testing import run_distributed


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _save_on_every_rank(directory: str):
    rt = rw.get_runtime()
    model = _net()
    torch.manual_seed(100 + rt.rank)  # each rank's RNG differs: all of them must be saved
    expected_next = torch.rand(2)
    torch.manual_seed(100 + rt.rank)
    # Each rank passes its own path: rank 0's wins, so all ranks agree on where it went.
    written = rw.save_checkpoint(Path(directory) / f"from-rank-{rt.rank}", model=model, step=5)
    fresh = _net()  # reseeds: the load must bring this rank's saved stream back
    info = rw.load_checkpoint(written, model=fresh)
    return str(written), info["meta"]["world_size"], torch.rand(2), expected_next


def test_every_rank_saves_one_file_chosen_by_rank_0(tmp_path):
    results = run_distributed(_save_on_every_rank, 3, args=(str(tmp_path),), timeout=90)
    paths = {r[0] for r in results}
    assert paths == {str(tmp_path / "from-rank-0" / "ckpt-00000005.pt")}
    assert sorted(os.listdir(tmp_path)) == ["from-rank-0"]
    for _path, world, got, expected in results:
        assert world == 3
        assert torch.equal(got, expected)  # each rank got its own RNG stream back


def _save_into_unwritable(path: str):
    try:
        rw.save_checkpoint(path, model=_net())
    except rw.DistributedError as exc:
        return str(exc)
    return "no error"


def test_failed_write_is_reported_on_every_rank_without_hanging(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    results = run_distributed(
        _save_into_unwritable, 2, args=(str(blocker / "ck" / "m.pt"),), timeout=60
    )
    for rank, text in enumerate(results):
        assert text.startswith(f"[rank {rank}] saving the checkpoint at")
        assert "failed on rank 0" in text and "previous checkpoint is untouched" in text


@pytest.fixture(scope="module")
def world2_checkpoint(tmp_path_factory) -> str:
    """One world-2 save for every load below (a load only reads it)."""
    folder = tmp_path_factory.mktemp("world2")
    run_distributed(_write_world2, 2, args=(str(folder),), timeout=120)
    return str(folder)


@pytest.mark.parametrize(("world", "into"), [(1, "bare"), (1, "dp"), (3, "torch-ddp"), (3, "ddp")])
def test_checkpoint_from_our_ddp_at_world_2_loads_anywhere(world2_checkpoint, world, into):
    # 120 s: a hang guard; 3 ranks starting on 2 loaded cores took over 60 s (load 15)
    results = run_distributed(_load_anywhere, world, args=(world2_checkpoint, into), timeout=120)
    reference = _net()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(1.0)
    for state in results:
        assert state.keys() == reference.state_dict().keys()
        assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


def _write_world2(directory: str):
    model = rw.DistributedDataParallel(_net())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    rw.save_checkpoint(directory, model=model, step=3)


def _load_anywhere(directory: str, into: str):
    bare = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = {
        "bare": lambda m: m,
        "dp": lambda m: rw.DataParallel(m, device_ids=["cpu", "cpu"]),
        "torch-ddp": lambda m: torch.nn.parallel.DistributedDataParallel(m),
        "ddp": rw.DistributedDataParallel,
    }[into](bare)
    info = rw.load_checkpoint(directory, model=model)
    assert info["meta"]["world_size"] == 2 and info["step"] == 3
    assert info["meta"]["strategy"] == "DistributedDataParallel"
    return bare.state_dict()
