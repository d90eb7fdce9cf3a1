# https://github.com/pytorch/pytorch/issues/70985
# mistake: each rank all-gathers its predictions, and the ranks hold different numbers of them
# expect-run: first dimension | rank 0 | rank 1 ; fix: gather_for_metrics
import torch

import rankwise as rw

rt = rw.init()
preds = torch.arange(5 if rt.rank == 0 else 3, dtype=torch.float32)
gathered = rw.all_gather(preds)
rt.print(torch.cat(gathered).shape)
