# https://github.com/ChenmienTan/RL2/issues/11
# mistake: the ranks use different batch sizes (16 and 8): the gradient average weighs a sample of the smaller batch twice as much
# expect-run: global batch 24 | 16 + 8 ; fix: global_batch_size
import torch
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw

rt = rw.init()
ds = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
model = torch.nn.Linear(8, 1)
batch = 16 if rt.rank == 0 else 8
model, opt, loader = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(ds, batch_size=batch))
