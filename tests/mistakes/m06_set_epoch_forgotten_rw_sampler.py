# https://discuss.pytorch.org/t/how-dose-distributed-sampler-passes-the-value-epoch-to-data-loader/110929
# mistake: `set_epoch` forgotten on `rw.DistributedSampler` iterated by hand
# expect: check RW005
import torch
from torch.utils.data import TensorDataset

import rankwise as rw

rt = rw.init()
ds = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
model = torch.nn.Linear(8, 1)
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
sampler = rw.DistributedSampler(ds, shuffle=True)
for epoch in range(2):
    for i in sampler:
        x, y = ds[i]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
