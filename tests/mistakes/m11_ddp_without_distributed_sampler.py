# https://github.com/openvla/openvla/issues/125
# mistake: DDP with a plain shuffled DataLoader: every process reads the whole data set
# expect: check RW004
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train_loader = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=8, shuffle=True)
for epoch in range(2):
    for x, y in train_loader:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
