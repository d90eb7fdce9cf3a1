# BatchNorm converted to its synchronised form before prepare; and a large batch elsewhere.
import torch
from torch.utils.data import DataLoader, TensorDataset
import rankwise as rw

rt = rw.init()
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
model = rw.convert_sync_batchnorm(model)
ds = TensorDataset(torch.randn(64, 8), torch.randn(64, 16))
model, opt, loader = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(ds, batch_size=4))
