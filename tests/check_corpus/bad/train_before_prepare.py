# A warm-up before rt.prepare: each rank steps its own copy and its own Adam state first.
import rankwise as rw
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

rt = rw.init(strategy="ddp")
model = torch.nn.Linear(4, 1)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
for x, y in DataLoader(data, batch_size=8, shuffle=True):  # expect: RW019
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
model, opt, loader = rt.prepare(model, opt, DataLoader(data, batch_size=8, shuffle=True))
for epoch in range(3):
    for x, y in loader:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
