# nanoGPT's order: scale, backward, unscale_, clip, step, update.
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
model = DDP(torch.nn.Linear(4, 1).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.cuda.amp.GradScaler(enabled=True)
for x, y in [(torch.randn(8, 4).cuda(), torch.randn(8, 1).cuda())]:
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
