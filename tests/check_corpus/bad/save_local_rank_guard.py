# pytorch/examples multigpu_torchrun.py: local rank 0 exists on every node, so each node saves.
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, model):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = DDP(model.to(self.gpu_id), device_ids=[self.gpu_id])

    def _save_snapshot(self, epoch):
        torch.save({"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}, "snapshot.pt")  # expect: RW015

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            if self.gpu_id == 0:
                self._save_snapshot(epoch)


dist.init_process_group("nccl")
Trainer(torch.nn.Linear(4, 1)).train(3)
