# https://github.com/catalyst-team/catalyst/issues/1023
# mistake: DDP with `batch_size * world_size` per process: the global batch becomes batch × N²
# expect: check RW012
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
world_size = dist.get_world_size()
ds = TensorDataset(torch.randn(64, 8))
model = DDP(torch.nn.Linear(8, 1))
loader = DataLoader(ds, batch_size=8 * world_size, sampler=DistributedSampler(ds))
