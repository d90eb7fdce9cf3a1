# Pitfall 6 (docs/pitfalls.md#pitfall-6): printing on every process ("很多快慢不一的信息").
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
for epoch in range(3):
    loss = torch.rand(())
    print(f"epoch {epoch} loss {loss.item():.4f}")  # expect: RW007
