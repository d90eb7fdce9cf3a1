"""A DDP job whose rank 1 reads each sample in 3 ms: an input straggler.

``slow_data_train.py [RELEASE_FILE]``: at the end every rank waits for RELEASE_FILE to exist
(at most 150 s), so that a test can look at the job while it runs.
"""

import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import rankwise as rw


class Samples(Dataset):
    slow = os.environ.get("RANK") == "1"

    def __len__(self) -> int:
        return 1600

    def __getitem__(self, i: int):
        if self.slow:
            time.sleep(0.003)
        return torch.randn(16), i % 4


rt = rw.init(strategy="ddp")
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt, loader = rt.prepare(model, opt, DataLoader(Samples(), batch_size=8))
for x, y in loader:
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
deadline = time.monotonic() + 150
while len(sys.argv) > 1 and not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.2)
rw.shutdown()
