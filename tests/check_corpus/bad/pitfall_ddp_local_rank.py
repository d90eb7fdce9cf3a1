# A classic published DDP example (docs/pitfalls.md#pitfall-local-rank). Its only pitfall: the local rank
# comes from `--local_rank` alone, which torchrun never passes.
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

# 1. 初始化group，使用默认backend(nccl)就行。如果是CPU模型运行，需要选择其他后端。
dist.init_process_group(backend="nccl")
# 2. 要加一个local_rank的参数
parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", default=-1)  # expect: RW010
args = parser.parse_args()
# 3. 从外面得到local_rank参数
local_rank = args.local_rank
# 4. 根据local_rank来设定当前使用哪块GPU
torch.cuda.set_device(local_rank)
# 5. 定义并把模型放置到单独的GPU上，在调用`model=DDP(model)`前。
device = torch.device("cuda", local_rank)
# 6. 封装之前要把模型移到对应的gpu
model = nn.Linear(10, 10)
model.to(device)
# 7. 之后才是初始化DDP模型
model = DDP(model, device_ids=[local_rank], output_device=local_rank)
