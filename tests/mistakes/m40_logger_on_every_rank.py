# https://github.com/TorchDR/TorchDR/issues/317
# mistake: `logging.getLogger(__name__).info(...)` on every rank: every INFO line once per rank
# expect: check RW007
import logging

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

logging.basicConfig(level=logging.INFO)
log = logging.getLogger(__name__)
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(8, 1))
for it in range(3):
    log.info("[%d/3] optimizing", it)
