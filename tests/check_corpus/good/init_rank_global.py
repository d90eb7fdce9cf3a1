# rank= is the global rank (or left out: env:// reads RANK); mp.spawn's index on one machine.
import os

import torch.distributed as dist
import torch.multiprocessing as mp


def worker(index, world_size):
    dist.init_process_group("gloo", rank=index, world_size=world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        mp.spawn(worker, args=(2,), nprocs=2)
