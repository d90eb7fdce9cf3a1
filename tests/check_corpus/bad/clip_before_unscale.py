# pytorch/examples minGPT-ddp trainer: clip_grad_norm_ on gradients still scaled by GradScaler.
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
model = DDP(torch.nn.Linear(4, 1).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cuda")
use_amp = True
for x, y in [(torch.randn(8, 4).cuda(), torch.randn(8, 1).cuda())]:
    loss = torch.nn.functional.mse_loss(model(x), y)
    if use_amp:
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: RW016
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
