# A deliberate local reference model (a one-process oracle), trained beside the prepared one.
import copy

import torch
import rankwise as rw
from torch.utils.data import DataLoader, TensorDataset

rt = rw.init()
ds = TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
model = torch.nn.Linear(8, 2)
reference = copy.deepcopy(model)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt, loader = rt.prepare(model, opt, DataLoader(ds, batch_size=8, shuffle=True))
for x, y in loader:
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
