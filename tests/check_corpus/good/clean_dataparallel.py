"""Single-process DataParallel (the classic DP example): prints are fine, the batch is global."""

import torch
import torch.nn as nn
from torch.nn import DataParallel
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda")
gpus = [0, 1, 2]
per_gpu_batch = 10
model = nn.Linear(10, 10)
model = model.to(device)
model = DataParallel(model, device_ids=gpus, output_device=gpus[0])
loader = DataLoader(
    TensorDataset(torch.randn(90, 10)),
    batch_size=per_gpu_batch * max(1, torch.cuda.device_count()),
    shuffle=True,
)
for epoch in range(2):
    for (x,) in loader:
        loss = model(x.to(device)).pow(2).mean()
        loss.backward()
    print(f"epoch {epoch} loss {loss.item():.4f}")
torch.save(model.module.state_dict(), "dp.pt")
