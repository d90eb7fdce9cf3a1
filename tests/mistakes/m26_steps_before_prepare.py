# https://github.com/kohya-ss/sd-scripts/pull/604
# mistake: a warm-up loop trains the bare model on every rank before `rt.prepare`: the other ranks' steps and optimizer state are lost
# expect: check RW019
import torch

import rankwise as rw

rt = rw.init()
model = torch.nn.Linear(8, 1)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for step in range(3):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
model, opt = rt.prepare(model, opt)
