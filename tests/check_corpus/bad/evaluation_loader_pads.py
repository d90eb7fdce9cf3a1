# The test set goes through a padding sampler; the evaluation loop counts the duplicates.
import torch
from torch.utils.data import DataLoader, TensorDataset
import rankwise as rw

rt = rw.init()
model, opt = rt.prepare(torch.nn.Linear(8, 2), None)
test_loader = rt.prepare_loader(DataLoader(TensorDataset(torch.randn(101, 8), torch.randint(0, 2, (101,))), batch_size=16))
seen = 0
for x, y in test_loader:  # expect: RW023
    seen += len(y)
