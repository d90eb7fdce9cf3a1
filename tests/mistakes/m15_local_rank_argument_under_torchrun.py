# https://github.com/XPixelGroup/BasicSR/issues/626
# mistake: the script reads `--local_rank` from argparse; torchrun passes nothing (LOCAL_RANK is in the environment)
# expect: check RW010
import argparse

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, required=True)
args = parser.parse_args()
dist.init_process_group("gloo")
device = torch.device("cpu", args.local_rank)
