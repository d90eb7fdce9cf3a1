# DDP built on every rank; only the logging is rank 0's.
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
if dist.get_rank() == 0:
    print("model wrapped")
