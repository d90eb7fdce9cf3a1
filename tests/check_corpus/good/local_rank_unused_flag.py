"""--local_rank is accepted (torch.distributed.launch passes it) but rankwise supplies the rank."""

import argparse

import rankwise as rw
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.parse_args()
rt = rw.init()
torch.manual_seed(rt.local_rank)
state = torch.load("weights.pt", map_location=rt.device, weights_only=True)
rw.print0(f"loaded {len(state)} tensors on local rank {rt.local_rank}")
