# https://github.com/meta-llama/llama-cookbook/issues/90
# mistake: `torch.cuda.set_device(rank)` with the global rank: "invalid device ordinal" on every node but the first
# expect: check RW013
import os

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
model = torch.nn.Linear(8, 2).to(rank)
