# Pitfall 2 (docs/pitfalls.md#pitfall-2): "RuntimeError: trying to initialize the default process group twice!"
import os

import torch
import torch.distributed as dist

dist.init_process_group(backend="nccl", init_method="env://")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
device = torch.device("cuda", local_rank)
# ... later, copied from another tutorial:
dist.init_process_group(backend="nccl", init_method="env://")  # expect: RW002
