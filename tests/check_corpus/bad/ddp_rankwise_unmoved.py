# rankwise's DDP under an alias, wrapping a freshly built model on a GPU run, chained .cuda().
import rankwise as rw
import torch.nn as nn

rt = rw.init(backend="nccl")
model = rw.DistributedDataParallel(nn.Linear(4, 4)).cuda()  # expect: RW001
