# The non-zero ranks leave early; the all_reduce below is reached by rank 0 alone.
import torch
import torch.distributed as dist


def evaluate(model, rank):
    if rank != 0:
        return None
    correct = torch.tensor([float(model(torch.ones(1, 4)).sum())])
    dist.all_reduce(correct)  # expect: RW009
    return correct


dist.init_process_group("gloo")
evaluate(torch.nn.Linear(4, 1), dist.get_rank())
