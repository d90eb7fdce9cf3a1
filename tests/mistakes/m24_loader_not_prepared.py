# https://discuss.pytorch.org/t/big-accuracy-gap-with-ddp/160455
# mistake: the model goes through `rt.prepare`, the training loader does not: each process reads the whole data set
# expect: check RW018
import torch
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw

rt = rw.init()
model = torch.nn.Linear(8, 1)
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
loader = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=8, shuffle=True)
for x, y in loader:
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
