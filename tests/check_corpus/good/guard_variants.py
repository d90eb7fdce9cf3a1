"""Rank guards and process-group set-ups in the many shapes real scripts use them."""

import argparse
import logging
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--backend", default="gloo", choices=["gloo", "mpi"])
args = parser.parse_args()
if args.local_rank == -1:
    args.local_rank = int(os.environ.get("LOCAL_RANK", 0))

# exclusive branches and an is_initialized guard: one init at run time
if args.backend == "mpi":
    dist.init_process_group("mpi")
else:
    dist.init_process_group("gloo")
if not dist.is_initialized():
    dist.init_process_group("gloo")

rank = dist.get_rank()
master_process = rank == 0
logger = logging.getLogger(__name__)
model = DDP(torch.nn.Linear(2, 2))


def is_main_process():
    return dist.get_rank() == 0


def report(msg):  # called only under a rank-0 guard below
    print(msg)


if args.local_rank in [-1, 0]:
    print("local master")
if is_main_process():
    logger.info("main process")
if master_process:
    report("nanoGPT style")
if not rank:
    print("rank is zero")
print(f"[rank {rank}] ready")  # names the rank on purpose
torch.save(model.module.state_dict(), f"shard_rank{rank}.pt")  # one file per rank
rank == 0 and print("short-circuit guard")
print("ternary guard") if rank == 0 else None
try:
    dist.barrier()
except RuntimeError as e:
    print("barrier failed:", e)  # error reports from any rank are wanted


def finish():
    if rank != 0:
        dist.barrier()
        return
    torch.save(model.module.state_dict(), "final.pt")
    dist.barrier()  # balanced: the other ranks wait in the branch above


def gather_sizes():
    t = torch.ones(1)
    if rank == 0:
        out = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.gather(t, gather_list=out, dst=0)
    else:
        dist.gather(t, dst=0)


finish()
gather_sizes()
for trial in range(2):  # re-initialising is fine once the group is destroyed
    dist.destroy_process_group()
    dist.init_process_group("gloo")
