# https://github.com/Lightning-AI/pytorch-lightning/issues/20255
# mistake: under zero3 the script reads the model's weights through `model.module` outside a gather (each rank holds a shard)
# expect-run: zero3 | module ; fix: rt.full_parameters
import torch

import rankwise as rw

rt = rw.init(strategy="zero3")
model = torch.nn.Linear(8, 2)
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
print(model.module.weight.norm())
