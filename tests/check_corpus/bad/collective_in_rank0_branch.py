# A barrier inside the rank-0 branch: rank 0 waits for ranks that never come.
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
if dist.get_rank() == 0:
    torch.save(model.module.state_dict(), "checkpoint.pt")
    dist.barrier()  # expect: RW009
