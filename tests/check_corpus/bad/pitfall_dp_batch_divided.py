# Pitfall 4 (docs/pitfalls.md#pitfall-4): with DP, batch_size is the total; dividing it by the device count (a DDP habit)
# makes each GPU see batch/N² samples.
import torch
import torch.nn as nn
from torch.nn import DataParallel
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda")
gpus = [0, 1, 2]
model = nn.Linear(10, 10)
model = model.to(device)
model = DataParallel(model, device_ids=gpus, output_device=gpus[0])
batch_size = 30 // len(gpus)  # expect: RW012
loader = DataLoader(TensorDataset(torch.randn(90, 10)), batch_size=batch_size, shuffle=True)
