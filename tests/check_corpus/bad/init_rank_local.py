# The local rank passed as the global rank: both nodes' local rank 0 claim rank 0.
import os

import torch.distributed as dist

local_rank = int(os.environ["LOCAL_RANK"])
world_size = int(os.environ["WORLD_SIZE"])
dist.init_process_group("nccl", rank=local_rank, world_size=world_size)  # expect: RW014
