# Pitfall 5 (docs/pitfalls.md#pitfall-5): saving net.state_dict() of a wrapped net prefixes every key with "module.".
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group(backend="nccl")
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local_rank)
net = nn.Linear(10, 10).to(device)
net = DDP(net, device_ids=[local_rank], output_device=local_rank)
if local_rank == 0:
    torch.save(net.state_dict(), "model.pt")  # expect: RW006  # expect: RW015
