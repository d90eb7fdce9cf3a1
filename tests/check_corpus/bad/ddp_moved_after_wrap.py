# Wrap first, move afterwards: the `.to(device)` comes one line too late.
import os

import torch
import torch.distributed as dist
import torch.nn as nn

dist.init_process_group(backend="nccl")
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local_rank)
net = nn.Sequential(nn.Linear(10, 10), nn.ReLU())
ddp_net = nn.parallel.DistributedDataParallel(net, device_ids=[local_rank])  # expect: RW001
ddp_net.to(device)
