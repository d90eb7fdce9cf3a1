# https://github.com/pytorch/pytorch/issues/101294
# mistake: under zero3 (a model large enough that the ranks of one machine share its parameters in memory), `rt.full_parameters(model)` entered on rank 0 only
# expect-run: ZeRO-3 | some ranks only | inside `if rt.rank == 0` ; fix: every rank | rt.full_parameters
# wrong: uneven data | pad the data or
import torch

import rankwise as rw

rt = rw.init(strategy="zero3")
model = torch.nn.Sequential(torch.nn.Linear(8, 600), torch.nn.ReLU(), torch.nn.Linear(600, 600),
                            torch.nn.ReLU(), torch.nn.Linear(600, 2))  # fmt: skip
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
model(torch.randn(4, 8)).pow(2).mean().backward()
opt.step()
if rt.rank == 0:
    with rt.full_parameters(model) as bare:
        print("norm", bare[2].weight.norm().item())
