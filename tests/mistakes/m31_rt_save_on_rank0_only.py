# https://github.com/huggingface/accelerate/issues/1171
# mistake: the checkpoint call is put under the main-process guard (`if rt.is_master: rt.save(...)`): it is a collective and hangs
# expect: check RW009
# expect-run: inside `if rt.is_master` ; fix: every rank
# wrong: uneven data
import torch

import rankwise as rw

rt = rw.init()
model = torch.nn.Linear(8, 1)
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
model(torch.randn(4, 8)).sum().backward()
opt.step()
if rt.is_master:
    rt.save("ckpt", model=model, optimizer=opt)
rw.barrier()
