# https://github.com/ultralytics/yolov3/issues/231
# mistake: `DataLoader(..., shuffle=True, sampler=DistributedSampler(ds))`
# expect: check RW003
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
ds = TensorDataset(torch.randn(32, 8))
sampler = DistributedSampler(ds)
loader = DataLoader(ds, batch_size=8, shuffle=True, sampler=sampler)
