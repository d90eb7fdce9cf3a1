# https://github.com/sanderwood/bgpt/issues/5
# mistake: `dist.all_reduce(loss)` then printed as the mean loss (it is the sum)
# expect: check RW021
import torch
import torch.distributed as dist

import rankwise as rw

rt = rw.init()
model = torch.nn.Linear(8, 1)
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
loss = torch.nn.functional.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 1))
loss.backward()
opt.step()
val_loss = loss.detach().clone()
dist.all_reduce(val_loss)
if rt.rank == 0:
    print(f"mean validation loss {val_loss.item():.4f}")
