"""Exact resume: stop mid-epoch, load the checkpoint, finish — bit-identical to never stopping."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import rankwise as rw
from rankwise.testing import run_distributed

TOTAL_STEPS = 14  # 2 ranks x 4 per device over 40 samples: 5 steps an epoch, so 3 epochs
STOP_AT = 7  # mid-epoch 1


def _train(ckpt_dir: str, stop_at: int | None, resume: bool) -> dict[str, torch.Tensor] | None:
    rt = rw.get_runtime()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))
    model = rw.DistributedDataParallel(
        nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = rw.loader(data, batch_size=4, shuffle=True)
    torch.manual_seed(1000 + rt.rank)  # dropout differs per rank: the RNG must be resumed too
    step, first_epoch = 0, 0
    if resume:
        info = rw.load_checkpoint(ckpt_dir, model=model, optimizer=opt, loader=loader)
        step, first_epoch = info["step"], info["epoch"]
    for epoch in range(first_epoch, 10):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == stop_at:
                rw.save_checkpoint(
                    ckpt_dir, model=model, optimizer=opt, loader=loader, step=step, epoch=epoch
                )
                return None  # the "crash"
            if step == TOTAL_STEPS:
                return {k: v.clone() for k, v in rw.unwrap_model(model).state_dict().items()}
    raise AssertionError("ran out of epochs")


def test_mid_epoch_resume_is_bit_identical_to_uninterrupted_run(tmp_path):
    straight = run_distributed(_train, 2, args=(str(tmp_path / "a"), None, False), timeout=120)
    run_distributed(_train, 2, args=(str(tmp_path / "b"), STOP_AT, False), timeout=120)
    resumed = run_distributed(_train, 2, args=(str(tmp_path / "b"), None, True), timeout=120)
    for rank in range(2):
        for name, value in straight[rank].items():
            assert torch.equal(resumed[rank][name], value), (rank, name)
    # And training actually moved the parameters (the comparison is not vacuous).
    torch.manual_seed(0)
    TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))
    initial = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    assert not torch.equal(initial[0].weight, straight[0]["0.weight"])
