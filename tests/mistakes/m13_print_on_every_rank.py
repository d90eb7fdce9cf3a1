# https://github.com/ashleve/lightning-hydra-template/issues/115
# mistake: progress printed by every process: each line appears world_size times, interleaved
# expect: check RW007
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.4f}")
