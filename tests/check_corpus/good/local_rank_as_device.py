# The same script with the local rank as the device and the global rank for rank-0 work.
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

rank = int(os.environ["RANK"])
local_rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group("nccl")
torch.cuda.set_device(local_rank)
model = torch.nn.Linear(10, 10).to(local_rank)
model = DDP(model, device_ids=[local_rank])
if rank == 0:
    torch.save(model.module.state_dict(), "model.pt")
