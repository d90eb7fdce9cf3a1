# pytorch/examples multinode.py: the device from LOCAL_RANK, the save guarded by the global RANK.
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, model):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = DDP(model.to(self.local_rank), device_ids=[self.local_rank])

    def _save_snapshot(self, epoch):
        torch.save({"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}, "snapshot.pt")

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            if self.global_rank == 0:
                self._save_snapshot(epoch)


dist.init_process_group("nccl")
Trainer(torch.nn.Linear(4, 1)).train(3)
