# Pitfall 3 (docs/pitfalls.md#pitfall-3): a DistributedSampler and shuffle=True ("sampler option is mutually exclusive with shuffle").
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

dist.init_process_group("gloo")
dataset = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
sampler = DistributedSampler(dataset)
loader = DataLoader(
    dataset,
    batch_size=8,
    sampler=sampler,
    shuffle=True,  # expect: RW003
)
