"""DDP on CPUs with gloo: the model never moves, and that is right (there is no device)."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
dataset = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
sampler = DistributedSampler(dataset, shuffle=False)
loader = DataLoader(dataset, batch_size=8, sampler=sampler)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(3):  # unshuffled sampler: set_epoch would change nothing
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
val_loader = DataLoader(dataset, batch_size=64)  # evaluation only: no backward, no sampler needed
with torch.no_grad():
    for x, y in val_loader:
        err = torch.nn.functional.mse_loss(model(x), y)
dist.all_reduce(err)
if dist.get_rank() == 0:
    print(f"val mse {err.item() / dist.get_world_size():.4f}")
