"""mp.spawn on several nodes: the global rank modulo the GPUs per node is the local rank, so the
first process of every node saves (several writers of one path on shared storage)."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def write_checkpoint(model, path):
    torch.save(model.state_dict(), path)  # expect: RW015


def worker(gpu, ngpus_per_node, node_rank, world_size):
    rank = node_rank * ngpus_per_node + gpu
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1).cuda(gpu), device_ids=[gpu])
    for epoch in range(3):
        if rank % ngpus_per_node == 0:
            write_checkpoint(model.module, "checkpoint.pt")


if __name__ == "__main__":
    n = torch.cuda.device_count()
    mp.spawn(worker, nprocs=n, args=(n, 0, 2 * n))
