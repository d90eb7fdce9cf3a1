# https://github.com/pytorch/ignite/issues/2623
# mistake: under zero2, `torch.save(opt.state_dict())` under `if rank == 0:` then a barrier (RW008's old advice)
# expect: check RW022
# expect-run: optimizer's state_dict() | some ranks only | inside `if rt.rank == 0` ; fix: rt.save | every rank
# wrong: uneven data
import torch
import torch.distributed as dist

import rankwise as rw

rt = rw.init(strategy="zero2")
model = torch.nn.Linear(8, 2)
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
model(torch.randn(4, 8)).sum().backward()
opt.step()
if rt.rank == 0:
    torch.save(opt.state_dict(), "opt.pt")
dist.barrier()
