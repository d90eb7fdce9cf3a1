# rankwise's save_checkpoint is a sync point for all ranks; calling it on the master only hangs.
import rankwise as rw
import torch

rt = rw.init()
model = rw.DistributedDataParallel(torch.nn.Linear(4, 1).to(rt.device))
if rt.is_master:
    rw.save_checkpoint("ckpt/", model=model)  # expect: RW009
