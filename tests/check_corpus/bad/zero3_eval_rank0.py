# Under zero3 the forward gathers every unit's parameters: evaluating on rank 0 only hangs.
import torch
import rankwise as rw

rt = rw.init(strategy="zero3")
model = torch.nn.Linear(8, 2)
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
if rt.rank == 0:
    with torch.no_grad():
        out = model(torch.randn(4, 8))  # expect: RW022
