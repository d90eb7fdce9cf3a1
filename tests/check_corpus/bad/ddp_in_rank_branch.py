# DDP's constructor broadcasts rank 0's parameters: built on rank 0 only, it waits forever.
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = torch.nn.Linear(4, 1)
if dist.get_rank() == 0:
    model = DDP(model)  # expect: RW009
