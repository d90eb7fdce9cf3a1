# https://github.com/zhijian-liu/torchpack/issues/18
# mistake: under zero1 the optimizer state is sharded, and `opt.state_dict()` is taken for the checkpoint on rank 0 only
# expect: check RW022
import torch

import rankwise as rw

rt = rw.init(strategy="zero1")
model = torch.nn.Linear(8, 2)
model, opt = rt.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
model(torch.randn(4, 8)).sum().backward()
opt.step()
if rt.rank == 0:
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, "ckpt.pt")
