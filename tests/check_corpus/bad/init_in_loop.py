# init_process_group inside a retry/trial loop with no destroy_process_group.
import torch.distributed as dist

for trial in range(3):
    dist.init_process_group("gloo")  # expect: RW002
    dist.barrier()
