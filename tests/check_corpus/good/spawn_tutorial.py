# pytorch/examples ddp-tutorial-series multigpu.py (abridged): mp.spawn's first argument is the
# rank, passed on as Trainer(gpu_id=rank); the guard, the per-rank print and the print before
# init_process_group are all fine.
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def ddp_setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    print("setting up the process group")
    torch.cuda.set_device(rank)
    dist.init_process_group(backend="nccl", rank=rank, world_size=world_size)


class Trainer:
    def __init__(self, model, train_data, gpu_id, save_every):
        self.gpu_id = gpu_id
        self.model = DDP(model.to(gpu_id), device_ids=[gpu_id])
        self.train_data = train_data
        self.save_every = save_every

    def _run_epoch(self, epoch):
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self.model(source.to(self.gpu_id)).sum().backward()

    def _save_checkpoint(self, epoch):
        torch.save(self.model.module.state_dict(), "checkpoint.pt")
        print(f"Epoch {epoch} | Training checkpoint saved at checkpoint.pt")

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_checkpoint(epoch)


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))


def main(rank, world_size, save_every, total_epochs):
    ddp_setup(rank, world_size)
    data = prepare_dataloader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), 8)
    Trainer(torch.nn.Linear(4, 1), data, rank, save_every).train(total_epochs)
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = torch.cuda.device_count()
    print(f"spawning {world_size} processes")
    mp.spawn(main, args=(world_size, 1, 3), nprocs=world_size)
