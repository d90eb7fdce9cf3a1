# https://discuss.pytorch.org/t/training-performance-degrades-with-distributeddataparallel/47152
# mistake: BatchNorm with 4 samples per process and no SyncBatchNorm: the statistics cover 4 samples, not the global batch
# expect: check RW024
# expect-run: BatchNorm meets a small per-rank batch | 4 sample(s) ; fix: rw.convert_sync_batchnorm(model)
import torch
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw

rt = rw.init()
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
ds = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
model, opt, loader = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(ds, batch_size=4, shuffle=True))
for x, y in loader:
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
