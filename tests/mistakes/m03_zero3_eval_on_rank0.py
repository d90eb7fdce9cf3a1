# https://github.com/deepspeedai/DeepSpeed/issues/860
# mistake: under zero3, evaluation on rank 0 only (`if rt.rank == 0: model(x)`)
# expect: check RW022
# expect-run: ZeRO-3 | some ranks only | inside `if rt.rank == 0` ; fix: every rank | rt.full_parameters | rt.save
# wrong: uneven data | pad the data or
import torch

import rankwise as rw

rt = rw.init(strategy="zero3")
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
model(torch.randn(4, 8)).pow(2).mean().backward()
opt.step()
if rt.rank == 0:
    with torch.no_grad():
        print("eval", model(torch.randn(4, 8)).sum().item())  # z3 line 15
