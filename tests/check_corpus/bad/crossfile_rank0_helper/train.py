"""A helper from another file, called under `if rank == 0:`, runs a collective: rank 0 waits in
it for ranks that never come (the rank guard is here, the collective in dist_helpers.py)."""

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
    if rank == 0:
        report(epoch, loss.item())  # expect: RW009
        helpers.save_and_sync(model.module, "ckpt.pt")  # expect: RW009
