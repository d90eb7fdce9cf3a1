# pytorch/examples multigpu.py without its set_epoch: the loader is built in a helper and kept
# on the Trainer, so every epoch repeats the first epoch's order.
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Trainer:
    def __init__(self, model, train_data, gpu_id):
        self.gpu_id = gpu_id
        self.model = DDP(model.to(gpu_id), device_ids=[gpu_id])
        self.train_data = train_data

    def _run_epoch(self, epoch):
        for source, targets in self.train_data:
            self.model(source.to(self.gpu_id)).sum().backward()

    def train(self, max_epochs):
        for epoch in range(max_epochs):  # expect: RW005
            self._run_epoch(epoch)


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))


def main(rank, world_size):
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    data = prepare_dataloader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), 8)
    Trainer(torch.nn.Linear(4, 1), data, rank).train(3)


if __name__ == "__main__":
    mp.spawn(main, args=(2,), nprocs=2)
