# dist.all_reduce sums by default; the sum is printed as the mean loss.
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
loss = torch.tensor(0.25)
dist.all_reduce(loss)
if dist.get_rank() == 0:
    print(f"mean loss {loss.item():.4f}")  # expect: RW021
