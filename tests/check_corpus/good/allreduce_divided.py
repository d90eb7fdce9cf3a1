# The all-reduced sum is divided by the world size before it is printed.
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
loss = torch.tensor(0.25)
dist.all_reduce(loss)
loss /= dist.get_world_size()
total_seen = torch.tensor(8.0)
dist.all_reduce(total_seen)
if dist.get_rank() == 0:
    print(f"mean loss {loss.item():.4f}, samples {total_seen.item():.0f}")
