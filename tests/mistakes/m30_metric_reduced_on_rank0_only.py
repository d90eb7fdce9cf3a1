# https://github.com/dvl-tum/center-group/pull/2
# mistake: the validation metric is averaged over ranks (a collective) inside `if rank == 0:`: rank 0 waits forever
# expect: check RW009
# expect-run: inside `if rt.rank == 0` | some ranks only ; fix: every rank
# wrong: uneven data
import torch

import rankwise as rw

rt = rw.init()
val_loss = torch.tensor(0.5 + rt.rank)
if rt.rank == 0:
    mean = rw.all_reduce_mean(val_loss)
    print(f"val loss {mean.item():.3f}")
rw.barrier()
