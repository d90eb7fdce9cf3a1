# https://github.com/google/gemma_pytorch/issues/1
# mistake: `torch.load(checkpoint)` of a downloaded file without `weights_only=True`: unpickling runs arbitrary code
# expect: check RW011
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = torch.nn.Linear(8, 2)
state = torch.load("downloaded_checkpoint.pt", map_location="cpu")
model.load_state_dict(state)
model = DDP(model)
