# https://github.com/mosaicml/composer/pull/1615
# mistake: each rank checks `os.path.exists(checkpoint)` on its own: a rank that does not see the file starts over, the ranks diverge and hang
# expect: check RW017
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = torch.nn.Linear(8, 1)
start_epoch = 0
if os.path.exists("last.pt"):
    snap = torch.load("last.pt", weights_only=True)
    model.load_state_dict(snap["model"])
    start_epoch = snap["epoch"] + 1
model = DDP(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(start_epoch, 3):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
