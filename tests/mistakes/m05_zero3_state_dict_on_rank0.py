# https://github.com/huggingface/accelerate/issues/1171
# mistake: under zero3, `model.state_dict()` taken on the main process only to save it
# expect: check RW022
# expect-run: ZeRO-3 | some ranks only | inside `if rt.is_master` ; fix: every rank | rt.save
# wrong: uneven data
import torch

import rankwise as rw

rt = rw.init(strategy="zero3")
model = torch.nn.Linear(8, 2)
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
model(torch.randn(4, 8)).sum().backward()
opt.step()
if rt.is_master:
    torch.save(model.state_dict(), "model.pt")
rw.barrier()
