# DP habit in a DDP script: batch_size multiplied by the world size, so each process loads N times more.
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

dist.init_process_group("gloo")
per_gpu_batch = 32
dataset = TensorDataset(torch.randn(256, 4))
loader = DataLoader(
    dataset,
    batch_size=per_gpu_batch * dist.get_world_size(),  # expect: RW012
    sampler=DistributedSampler(dataset, shuffle=False),
)
