# https://github.com/NVIDIA-NeMo/Automodel/issues/3254
# mistake: a new run saves into a folder that already holds a checkpoint of an earlier run, without resuming from it
# expect-run: already holds a checkpoint | ckpt ; fix: rt.load
import torch

import rankwise as rw

rt = rw.init()
model = torch.nn.Linear(8, 1)
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
rt.save("ckpt", model=model, optimizer=opt, step=5)  # the earlier run
model(torch.randn(4, 8)).sum().backward()
opt.step()
rt.save("ckpt", model=model, optimizer=opt, step=5)  # the new run, same folder, never loaded
