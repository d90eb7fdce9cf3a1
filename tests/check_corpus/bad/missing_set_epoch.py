# The epoch loop never calls set_epoch: every epoch repeats epoch 0's order on every rank.
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def train_one_epoch(model, opt, loader):
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


dist.init_process_group("gloo")
dataset = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
sampler = DistributedSampler(dataset, shuffle=True)
train_loader = DataLoader(dataset, batch_size=8, sampler=sampler)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(10):  # expect: RW005
    train_one_epoch(model, opt, train_loader)
