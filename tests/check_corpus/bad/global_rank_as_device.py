# pytorch/examples distributed/ddp/example.py: the global RANK as a device index (node 1 of 2
# x 4 GPUs asks for cuda:4..7).
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

rank = int(os.environ["RANK"])
dist.init_process_group("nccl")
model = torch.nn.Linear(10, 10).cuda()
model = DDP(model, device_ids=[rank])  # expect: RW013
