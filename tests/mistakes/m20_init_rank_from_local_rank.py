# https://github.com/pytorch/pytorch/issues/23074
# mistake: `init_process_group(rank=local_rank, world_size=4)` on 2 nodes: ranks 2 and 3 never arrive, the rendezvous hangs
# expect: check RW014
import os

import torch.distributed as dist

local_rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group("gloo", init_method="env://", rank=local_rank, world_size=4)
