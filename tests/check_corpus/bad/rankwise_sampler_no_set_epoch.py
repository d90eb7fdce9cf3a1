# rw.DistributedSampler iterated by hand, epoch after epoch, without set_epoch.
import torch
import rankwise as rw
from torch.utils.data import TensorDataset

rt = rw.init()
ds = TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = rt.prepare(model, opt)
sampler = rw.DistributedSampler(ds, shuffle=True)
for epoch in range(3):  # expect: RW005
    for i in sampler:
        x, y = ds[i]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
