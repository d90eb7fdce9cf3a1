# https://github.com/pytorch/pytorch/issues/70985
# mistake: each rank all-gathers its predictions with `dist.all_gather`, and the ranks hold different numbers of them
# expect-run: all_gather | rank 0 | rank 1 ; fix: gather_for_metrics
import torch
import torch.distributed as dist

import rankwise as rw

rt = rw.init()
preds = torch.arange(5 if rt.rank == 0 else 3, dtype=torch.float32)
gathered = [torch.zeros_like(preds) for _ in range(rt.world_size)]
dist.all_gather(gathered, preds)
rt.print(torch.cat(gathered).shape)
