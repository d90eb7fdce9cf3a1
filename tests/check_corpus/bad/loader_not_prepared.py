# The one-call API with the loader left out of rt.prepare: every rank reads all 64 samples.
import rankwise as rw
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

rt = rw.init()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = rt.prepare(model, opt)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=True)  # expect: RW018
for epoch in range(2):
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
