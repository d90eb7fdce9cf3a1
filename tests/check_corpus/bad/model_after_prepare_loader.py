# The loader goes through rt.prepare_loader; the model built after it never goes through rt.prepare.
import torch
import rankwise as rw
from torch.utils.data import DataLoader, TensorDataset

rt = rw.init()
ds = TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
loader = rt.prepare_loader(DataLoader(ds, batch_size=8, shuffle=True))
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)  # expect: RW019
for x, y in loader:
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
