# Rank 0 decides whether to resume and tells the others.
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
model = torch.nn.Linear(4, 1).to(local_rank)
epochs_run = 0
found = [os.path.exists("snapshot.pt")]
dist.broadcast_object_list(found, src=0)
if found[0] and os.path.exists("snapshot.pt"):
    snapshot = torch.load("snapshot.pt", map_location=f"cuda:{local_rank}", weights_only=True)
    model.load_state_dict(snapshot["MODEL_STATE"])
    epochs_run = snapshot["EPOCHS_RUN"]
model = DDP(model, device_ids=[local_rank])
