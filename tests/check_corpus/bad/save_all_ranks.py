# torch.save of the bare module, but from every rank at once.
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
torch.save(model.module.state_dict(), "checkpoint.pt")  # expect: RW008
