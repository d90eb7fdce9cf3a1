# https://github.com/kohya-ss/sd-scripts/issues/924
# mistake: the loader goes through `rt.prepare_loader`, the model built after it never goes through `rt.prepare`
# expect: check RW019
import torch
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw

rt = rw.init()
ds = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
loader = rt.prepare_loader(DataLoader(ds, batch_size=8, shuffle=True))
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
