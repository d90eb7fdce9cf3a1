# https://github.com/NVIDIA/apex/issues/696
# mistake: the epoch loss is all-reduced (a SUM) and logged as the average loss
# expect: check RW021
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(8, 1))
running = torch.zeros(1)
for step in range(4):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    running += loss.detach()
avg_loss = running / 4
dist.all_reduce(avg_loss)
if dist.get_rank() == 0:
    print(f"epoch average loss {avg_loss.item():.4f}")
