# https://github.com/intelligent-machine-learning/dlrover/pull/786
# mistake: saving under `if local_rank == 0:`: every node has a local rank 0, so several nodes write the same file
# expect: check RW015
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
local_rank = int(os.environ["LOCAL_RANK"])
model = DDP(torch.nn.Linear(8, 1))
if local_rank == 0:
    torch.save(model.module.state_dict(), "/shared/ckpt.pt")
dist.barrier()
