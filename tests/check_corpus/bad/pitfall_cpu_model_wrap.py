# Pitfall 1 (docs/pitfalls.md#pitfall-1): the model is wrapped while still on the CPU ("AssertionError: DistributedDataParallel
# device_ids and output_device arguments only work with single-device GPU modules ... {device(type='cpu')}").
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group(backend="nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = nn.Linear(10, 10)
model = DDP(model, device_ids=[local_rank], output_device=local_rank)  # expect: RW001
