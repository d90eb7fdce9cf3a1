# https://github.com/pytorch/examples/issues/1196
# mistake: `clip_grad_norm_` on the scaled gradients (no `scaler.unscale_` first): the clip threshold means nothing
# expect: check RW016
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for step in range(2):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 8)).pow(2).mean()
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
