"""Train with a checkpoint every step; optionally SIGKILL rank 1 once, mid-training.

    restart_train.py CKPT_DIR OUT_FILE [--kill-at STEP]

Under `rankwise run --max-restarts 1` the agent restarts the group after the kill, this script
resumes from the latest checkpoint, and the final parameters must equal an uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import rankwise as rw

TOTAL_STEPS = 12


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()
    rt = rw.init(timeout=60)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(48, 6), torch.randint(0, 3, (48,)))
    model = rw.DistributedDataParallel(
        nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = rw.loader(data, batch_size=4, shuffle=True)
    torch.manual_seed(1000 + rt.rank)
    step, first_epoch = 0, 0
    if rw.list_checkpoints(args.ckpt):
        info = rw.load_checkpoint(args.ckpt, model=model, optimizer=opt, loader=loader)
        step, first_epoch = info["step"], info["epoch"]
        rw.print0(f"resumed from step {step}")
    for epoch in range(first_epoch, 100):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            rw.save_checkpoint(
                args.ckpt,
                model=model,
                optimizer=opt,
                loader=loader,
                step=step,
                epoch=epoch,
                keep_last=2,
            )
            if first_attempt and step == args.kill_at and rt.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == TOTAL_STEPS:
                if rt.is_master:
                    torch.save(rw.unwrap_model(model).state_dict(), args.out)
                rw.shutdown()
                return


if __name__ == "__main__":
    main()
