# https://github.com/NVIDIA/apex/issues/629
# mistake: every process writes the same checkpoint file: some checkpoints cannot be loaded ("storage has wrong size")
# expect: check RW008
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(8, 1))
torch.save({"model": model.module.state_dict(), "epoch": 1}, "checkpoint.pt")
