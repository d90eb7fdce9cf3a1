# https://github.com/pytorch/pytorch/issues/163546
# mistake: one rank raises in the middle of training (a bad batch, out of memory); the others wait in the next collective until the timeout
# expect-run: rank 1 raised ValueError | bad batch ; fix: rank 1's exception is the cause
import torch

import rankwise as rw

rt = rw.init()
model = rw.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    if step == 3 and rt.rank == 1:
        raise ValueError(f"bad batch at step {step}")
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
