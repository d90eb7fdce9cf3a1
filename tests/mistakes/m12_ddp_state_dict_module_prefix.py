# https://stackoverflow.com/questions/61854165/why-must-use-dataparallel-when-testing
# mistake: `torch.save(ddp_model.state_dict())`: every key gets `module.`, and the bare model cannot load it
# expect: check RW006
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(8, 2))
if dist.get_rank() == 0:
    torch.save(model.state_dict(), "model.pt")
dist.barrier()
