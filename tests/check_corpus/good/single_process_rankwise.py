# strategy="single": one process, nothing to split; a plain loader and a plain optimizer are fine.
import rankwise as rw
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

rt = rw.init(strategy="single")
model = torch.nn.Linear(4, 1)
model = rt.prepare(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8):
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
