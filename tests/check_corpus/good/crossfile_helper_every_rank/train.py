"""The helpers of dist_helpers.py called as they must be: the collective ones on every rank,
the rank-0 work (describe: no collective) under `if rank == 0:`."""

import torch
import torch.distributed as dist
from dist_helpers import describe, report
import dist_helpers as helpers

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if rank == 0:
    print(describe(model.module))
for epoch in range(3):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    report(epoch, loss.item())
    helpers.save_and_sync(model.module, "ckpt.pt")
