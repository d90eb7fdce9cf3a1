# Under zero2, opt.state_dict() gathers every rank's shard: under `if rank == 0:` it hangs.
import torch
import torch.distributed as dist
import rankwise as rw

rt = rw.init(strategy="zero2")
model, opt = rt.prepare(torch.nn.Linear(8, 2), torch.optim.Adam)
if rt.rank == 0:
    torch.save(opt.state_dict(), "opt.pt")  # expect: RW022
dist.barrier()
