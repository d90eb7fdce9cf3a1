# Under zero3 every rank saves and gathers; rank 0 alone computes on the gathered copy.
import torch
import rankwise as rw

rt = rw.init(strategy="zero3")
model = torch.nn.Linear(8, 2)
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
state = opt.state_dict()
with rt.full_parameters(model) as bare:
    if rt.rank == 0:
        with torch.no_grad():
            out = bare(torch.randn(4, 8))
rt.save("ckpt", model=model, optimizer=opt)
