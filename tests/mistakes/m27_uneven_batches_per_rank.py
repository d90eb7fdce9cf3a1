# https://discuss.pytorch.org/t/training-hangs-on-loss-backward-with-ddp-nnodes-2-nproc-per-node-3/220127
# mistake: each rank builds its own shard with a different number of batches: the rank with fewer leaves the loop, the other hangs in backward
# expect-run: Uneven data | stopped training ; fix: rw.loader | join
import torch
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw

rt = rw.init()
n = 48 if rt.rank == 0 else 24
loader = DataLoader(TensorDataset(torch.randn(n, 8), torch.randn(n, 1)), batch_size=8)
model = rw.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
