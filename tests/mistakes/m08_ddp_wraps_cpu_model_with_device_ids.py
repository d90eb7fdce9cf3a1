# https://github.com/pytorch/pytorch/issues/46821
# mistake: DDP wraps the model before it is moved to its device (`DDP(model, device_ids=[local_rank])`, then `.to(device)`)
# expect: check RW001
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local_rank)
model = DDP(torch.nn.Linear(8, 2), device_ids=[local_rank])
model.to(device)
